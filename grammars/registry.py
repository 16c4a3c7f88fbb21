"""Grammar backends by name, imported only when asked for (CLI choices come from here)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from .base import GrammarBackend

DEFAULT_BACKEND = "xgrammar"

# name -> "module:class", relative to this package; importing a backend pulls in its library.
_BACKENDS: dict[str, str] = {
    "xgrammar": "xgrammar_backend:XGrammarBackend",
    "llguidance": "llguidance_backend:LLGuidanceBackend",
    "outlines": "outlines_backend:OutlinesBackend",
}

BACKEND_NAMES: tuple[str, ...] = tuple(_BACKENDS)


def backend_class(name: str) -> type[GrammarBackend]:
    """The backend class registered under ``name`` (imports its module).

    Raises
    ------
    ValueError
        For an unknown name (the message lists the known ones).
    """
    target = _BACKENDS.get(name)
    if target is None:
        raise ValueError(f"unknown grammar backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    module_name, class_name = target.split(":")
    module = importlib.import_module(f"{__package__}.{module_name}")
    return getattr(module, class_name)


def create_backend(
    name: str = DEFAULT_BACKEND,
    *,
    tokenizer: Any,
    vocab_size: int,
    stop_token_ids: Sequence[int],
    **opts: Any,
) -> GrammarBackend:
    """Build the backend ``name`` for one model.

    Parameters
    ----------
    name : str
        One of :data:`BACKEND_NAMES`.
    tokenizer : transformers.PreTrainedTokenizerFast
        The model's tokenizer.
    vocab_size : int
        Width of the model's logits (may exceed the tokenizer's size).
    stop_token_ids : Sequence[int]
        Tokens that end generation.
    **opts
        Backend-specific keyword options (see each backend class).
    """
    cls = backend_class(name)
    return cls(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids, **opts)
