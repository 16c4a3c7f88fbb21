"""Grammar objects split by lifecycle: a backend per model, a matcher per request.

A :class:`GrammarBackend` is built once per model from its Hugging Face tokenizer and compiles
:class:`GrammarSpec` values into :class:`CompiledGrammar` values (immutable, shareable across
requests and threads). Each constrained request owns one :class:`GrammarMatcher`, which tracks how far
the output has advanced through the grammar.

Bitmask convention (shared by every backend and by :mod:`phloem.grammars.bitmask`): a mask row is
``ceil(vocab_size / 32)`` int32 words; bit ``j`` of word ``w`` allows token ``32 * w + j``.
"""

from __future__ import annotations

import abc
import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


class GrammarError(ValueError):
    """A grammar spec was rejected: invalid, unsupported by the backend, too large, or too slow."""


class GrammarKind(str, enum.Enum):
    """What the text of a :class:`GrammarSpec` means."""

    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    EBNF = "ebnf"
    STRUCTURAL_TAG = "structural_tag"
    JSON_OBJECT = "json_object"


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar as a request states it; hashable, the key of the compile cache.

    Parameters
    ----------
    kind : GrammarKind
        How to read ``text`` (a plain string such as ``"regex"`` is converted).
    text : str
        The schema (JSON text), regex, EBNF grammar or structural tag (JSON text). Ignored for
        ``json_object``, which always means "any JSON object".
    """

    kind: GrammarKind
    text: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", GrammarKind(self.kind))
        if self.kind is GrammarKind.JSON_OBJECT:
            object.__setattr__(self, "text", "")

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """The builtin grammar of any JSON object."""
        return cls(GrammarKind.JSON_OBJECT)


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A compiled grammar: immutable and safe to share between matchers and threads.

    Parameters
    ----------
    spec : GrammarSpec
        The spec it was compiled from.
    backend_name : str
        Name of the backend that compiled it; only that backend can make matchers for it.
    handle : Any
        The backend's native compiled object.
    """

    spec: GrammarSpec
    backend_name: str
    handle: Any


class GrammarMatcher(abc.ABC):
    """Per-request grammar state: which tokens may come next, given those accepted so far.

    A matcher is used by one thread at a time. Once terminated (a stop token was accepted in an
    accepting state) it accepts nothing more; its mask then allows only stop tokens.
    """

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance over one sampled token.

        Mutates the matcher only when the token is allowed; a rejected token leaves the state exactly
        as it was.

        Returns
        -------
        bool
            Whether the token was allowed (and is now accepted).
        """

    @abc.abstractmethod
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into ``bitmask[row]``.

        Mutates only ``bitmask[row]`` (every word of it); the matcher itself is unchanged.

        Parameters
        ----------
        bitmask : torch.Tensor
            CPU int32 tensor ``[batch, ceil(vocab_size / 32)]``, contiguous (see
            :func:`phloem.grammars.bitmask.allocate_bitmask`).
        row : int
            Which batch row to fill.
        """

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a terminated matcher becomes live again).

        Mutates the matcher. Raises ``ValueError`` when asked to undo more tokens than were accepted.
        """

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """Whether a stop token has been accepted; read-only."""

    @abc.abstractmethod
    def find_jump_forward_string(self) -> str:
        """The text every valid continuation must start with (may be empty); read-only.

        The matcher is not advanced: the caller retokenizes the text and accepts the tokens it
        chooses (see :mod:`phloem.grammars.jump_forward`).
        """

    @abc.abstractmethod
    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (e.g. for forked requests); read-only."""

    @property
    @abc.abstractmethod
    def num_accepted(self) -> int:
        """How many tokens are currently accepted (what :meth:`rollback` can undo)."""

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Accept tokens in order until one is rejected; returns how many were accepted."""
        for count, token_id in enumerate(token_ids):
            if not self.accept_token(token_id):
                return count
        return len(token_ids)


class GrammarBackend(abc.ABC):
    """Per-model grammar compiler.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerFast
        The model's tokenizer (vocabulary and special tokens are read once, here).
    vocab_size : int
        Width of the model's logits; may exceed the tokenizer's size (extra ids are never allowed).
    stop_token_ids : Sequence[int]
        Tokens that end generation; a matcher allows them only where the grammar may end.
    """

    name: ClassVar[str] = ""
    supported_kinds: ClassVar[frozenset[GrammarKind]] = frozenset(GrammarKind)

    def __init__(self, tokenizer: Any, *, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if not stop_token_ids:
            raise ValueError("stop_token_ids must name at least one token")
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile a spec. Thread-safe; the result is immutable.

        Raises
        ------
        GrammarError
            When the spec is invalid or this backend does not support its kind or features.
        """
        if spec.kind not in self.supported_kinds:
            raise GrammarError(f"the {self.name} grammar backend does not support {spec.kind.value} grammars")
        try:
            handle = self._compile(spec)
        except GrammarError:
            raise
        except Exception as exc:  # backends raise assorted types for bad input
            raise GrammarError(f"invalid {spec.kind.value} grammar: {_one_line(exc)}") from exc
        return CompiledGrammar(spec=spec, backend_name=self.name, handle=handle)

    def new_matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``; cheap compared with :meth:`compile`."""
        if compiled.backend_name != self.name:
            raise ValueError(f"grammar compiled by {compiled.backend_name!r}, not {self.name!r}")
        return self._new_matcher(compiled.handle)

    @abc.abstractmethod
    def _compile(self, spec: GrammarSpec) -> Any:
        """Compile to the backend's native object; may raise anything on bad input."""

    @abc.abstractmethod
    def _new_matcher(self, handle: Any) -> GrammarMatcher:
        """A matcher over a native compiled object returned by :meth:`_compile`."""


def fill_stop_only(bitmask: torch.Tensor, row: int, stop_token_ids: Sequence[int]) -> None:
    """Write a mask row that allows exactly ``stop_token_ids``."""
    bitmask[row].zero_()
    for token_id in stop_token_ids:
        word, bit = divmod(token_id, 32)
        bitmask[row, word] |= _bit_value(bit)


def _bit_value(bit: int) -> int:
    """The int32 value with only ``bit`` set (bit 31 is the sign bit)."""
    return -(1 << 31) if bit == 31 else 1 << bit


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line, without C++ source locations, capped for HTTP bodies."""
    text = _SOURCE_LOCATION.sub("", str(exc))
    text = " ".join(text.split()) or type(exc).__name__
    return text[:500]


# "[16:51:38] /project/cpp/regex_converter.cc:94: " prefixes in native library errors
_SOURCE_LOCATION = re.compile(r"\[\d\d:\d\d:\d\d\] \S+?:\d+: ")
