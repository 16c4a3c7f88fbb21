"""phloem: structured-generation programs with a bundled serving runtime.

``import phloem as ph`` gives the DSL verbs (``ph.function``, ``ph.gen``, ``ph.select`` ...) without
importing torch; ``ph.Engine`` loads the runtime on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from phloem.runtime.engine import Engine  # noqa: F401


def __getattr__(name: str) -> Any:
    # Lazy on purpose: the DSL must import without torch, and the runtime is heavy.
    if name == "Engine":
        from phloem.runtime.engine import Engine

        return Engine
    import phloem.lang as lang

    if name in getattr(lang, "__all__", ()):
        return getattr(lang, name)
    raise AttributeError(f"module 'phloem' has no attribute {name!r}")


def __dir__() -> list[str]:
    import phloem.lang as lang

    return sorted({"Engine", "__version__", *getattr(lang, "__all__", ())})
