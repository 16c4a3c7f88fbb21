"""The Backend interface: the only way the DSL reaches a model.

A backend receives resolved, wire-neutral requests (:class:`GenerateRequest`, :class:`SelectRequest`)
and owns their mapping onto its transport. Every method may be called from several threads at once
(one per running program or fork branch); implementations must be thread-safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from phloem.lang.chat_template import ChatTemplate
from phloem.lang.choices import ChoiceLogprobs
from phloem.lang.ir import Constraint, LogprobOptions, SamplingParams


class BackendError(RuntimeError):
    """A backend failed to serve a request (transport error, HTTP error, aborted request)."""


class BackendCapabilityError(BackendError):
    """The backend cannot do what the program asks (for example ``select`` without logprobs)."""


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One generation at the end of ``text``.

    ``messages`` are the finished chat turns before it and ``open_role``/``open_role_text`` the turn
    in progress, for backends that speak a chat protocol rather than raw text.
    """

    text: str
    params: SamplingParams = field(default_factory=SamplingParams)
    constraint: Constraint | None = None
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    messages: tuple[dict[str, str], ...] = ()
    open_role: str | None = None
    open_role_text: str = ""


@dataclass(frozen=True, kw_only=True)
class GenerateOutput:
    """Generated samples (one unless ``n > 1``) and their meta info, in order."""

    texts: tuple[str, ...]
    meta_infos: tuple[dict[str, Any], ...]

    @property
    def text(self) -> str:
        return self.texts[0]

    @property
    def meta_info(self) -> dict[str, Any]:
        return self.meta_infos[0]


@dataclass(frozen=True, kw_only=True)
class StreamChunk:
    """A piece of streamed text; the last chunk of a stream carries the meta info."""

    delta: str
    meta_info: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class SelectRequest:
    """Score ``choices`` as continuations of ``prefix``; ``unconditional`` asks for context-free
    log probabilities as well."""

    prefix: str
    choices: tuple[str, ...]
    unconditional: bool = False


class Backend(ABC):
    """Serves the DSL's requests. Subclasses implement :meth:`model_info`, :meth:`generate` and
    :meth:`choice_logprobs`; streaming, prefix caching and the chat template have defaults."""

    _template: ChatTemplate | None = None

    @abstractmethod
    def model_info(self) -> dict[str, Any]:
        """Model facts (``model_path``, optionally ``chat_template``). May be cached by the caller."""

    @abstractmethod
    def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Run one generation to completion. Raises :class:`BackendError` on failure or abort."""

    @abstractmethod
    def choice_logprobs(self, request: SelectRequest) -> ChoiceLogprobs:
        """Per-token log probabilities of each choice's tokens after ``prefix`` (token-healed)."""

    def generate_stream(self, request: GenerateRequest) -> Iterator[StreamChunk]:
        """Yield the generation as it is produced. The default yields the whole output at once."""
        out = self.generate(request)
        yield StreamChunk(delta=out.text, meta_info=out.meta_info)

    def cache_prefix(self, text: str) -> None:  # noqa: B027 - an optional hook
        """Ask the server to compute and keep ``text``'s KV (a prefill-only request). Default: no-op."""

    def chat_template(self) -> ChatTemplate:
        """The template for role markers: the model's own, else the registered default."""
        if self._template is None:
            self._template = ChatTemplate.from_model_info(self.model_info())
        return self._template

    def close(self) -> None:  # noqa: B027 - an optional hook
        """Release connections. Default: nothing to release."""
