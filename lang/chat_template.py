"""Rendering chat roles with a model's jinja2 chat template.

A program writes roles one piece at a time (``user_begin()``, text, a ``gen``, ``user_end()``), so the
template is not rendered over a finished message list. Instead each role's *markers* (the text before
and after a message's content) are derived once by rendering the template around a sentinel content
and diffing against the render without that message. Templates come from the backend's model info
(``chat_template`` key) or from the registry here (``chatml`` is the default).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

logger = logging.getLogger(__name__)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_SENTINEL = "\u2063PHLOEM-CONTENT\u2063"
_FILLER = "\u2062PHLOEM-FILLER\u2062"
_REGISTRY: dict[str, str] = {"chatml": CHATML}
DEFAULT_TEMPLATE = "chatml"


@dataclass(frozen=True, kw_only=True)
class RoleMarkers:
    """Text a template puts before (``prefix``) and after (``suffix``) one message's content."""

    prefix: str
    suffix: str


def register_chat_template(name: str, source: str, *, overwrite: bool = False) -> None:
    """Register a jinja2 chat template under ``name`` (for backends whose model info has none)."""
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"chat template {name!r} is already registered")
    _REGISTRY[name] = source


def registered_chat_template(name: str) -> str:
    """The source of a registered template."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no chat template named {name!r}; registered: {sorted(_REGISTRY)}") from None


class ChatTemplate:
    """A compiled chat template that renders whole conversations and per-role markers.

    ``bos_token`` defaults to ``""``: the runtime's tokenizer adds BOS itself, so the program text
    must not contain it a second time.
    """

    def __init__(self, source: str, *, name: str | None = None, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.name = name or "custom"
        self._extra = {"bos_token": bos_token, "eos_token": eos_token}
        self._compiled = _compile(source)
        self._markers: dict[tuple[str, bool], RoleMarkers] = {}

    @classmethod
    def registered(cls, name: str = DEFAULT_TEMPLATE) -> ChatTemplate:
        """A template from the registry."""
        return cls(registered_chat_template(name), name=name)

    @classmethod
    def from_model_info(cls, info: Mapping[str, Any], *, fallback: str = DEFAULT_TEMPLATE) -> ChatTemplate:
        """The model's own template when its info carries one, else the registered ``fallback``."""
        source = info.get("chat_template")
        if isinstance(source, str) and source.strip():
            return cls(source, name=str(info.get("model_path") or "model"))
        return cls.registered(fallback)

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = False) -> str:
        """Render a full conversation, as the server would for a chat request."""
        return self._compiled.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **self._extra
        )

    def markers(self, role: str, *, first: bool = False) -> RoleMarkers:
        """The prefix and suffix this template wraps around a ``role`` message's content.

        ``first`` asks for the markers of the conversation's first message: a template may add text
        there (a default system prompt when the first message is not a system one), and the program
        text must match what the template renders for the same messages.
        """
        key = (role, first)
        if key not in self._markers:
            self._markers[key] = self._derive_markers(role, first=first)
        return self._markers[key]

    def _derive_markers(self, role: str, *, first: bool) -> RoleMarkers:
        contexts = _contexts_for(role)
        if first:  # the conversation's first message: the template may add text before it
            contexts = [[], *contexts]
        for context in contexts:
            found = self._markers_after(context, role)
            if found is not None:
                return found
        logger.warning("chat template %s: cannot derive %r markers; using ChatML", self.name, role)
        return RoleMarkers(prefix=f"<|im_start|>{role}\n", suffix="<|im_end|>\n")

    def _conversation_start(self) -> str:
        """What the template emits for no messages (a BOS token, say); never part of a role's markers."""
        try:
            return self.render([])
        except Exception:
            return ""

    def _markers_after(self, context: list[dict[str, str]], role: str) -> RoleMarkers | None:
        try:
            before = self.render(context) if context else self._conversation_start()
            after = self.render([*context, {"role": role, "content": _SENTINEL}])
        except Exception:  # a template may reject a role order with raise_exception
            return None
        if not after.startswith(before) or after.count(_SENTINEL) != 1:
            return None
        prefix, suffix = after[len(before) :].split(_SENTINEL)
        if _FILLER in prefix or _FILLER in suffix:  # the template moved earlier turns into this one
            return None
        return RoleMarkers(prefix=prefix, suffix=suffix)


def _contexts_for(role: str) -> list[list[dict[str, str]]]:
    """Conversations to render before a ``role`` message: the natural one first, then simpler ones."""
    system = {"role": "system", "content": _FILLER}
    user = {"role": "user", "content": _FILLER}
    if role == "system":
        return [[]]
    if role == "assistant":
        return [[system, user], [user]]
    return [[system], []]


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
