"""Grammar backend over llguidance (Earley parser with a lazy lexer): all five grammar kinds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from .base import GrammarBackend, GrammarError, GrammarKind, GrammarMatcher, GrammarSpec, fill_stop_only
from .structural_tag import normalize_structural_tag, structural_tag_to_lark

_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidanceMatcher(GrammarMatcher):
    """Matcher over ``llguidance.LLMatcher``.

    llguidance puts a matcher into a permanent error state when it consumes a disallowed token, so
    every token is validated before it is consumed.
    """

    def __init__(
        self,
        inner: llguidance.LLMatcher,
        *,
        stop_token_ids: Sequence[int],
        history: list[tuple[bool, bool]],
    ):
        self._inner = inner
        self._stop_token_ids = tuple(stop_token_ids)
        # One entry per accepted token: (is a stop token, counted in llguidance's own history).
        # A stop token consumed after the parser has already stopped is not counted there.
        self._history = history

    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)
        if self.is_terminated() or not self._allows(token_id):
            return False
        is_stop = token_id in self._stop_token_ids
        counted = not (is_stop and self._inner.is_stopped())
        if not self._inner.consume_token(token_id):
            raise RuntimeError(f"llguidance matcher failed after validation: {self._inner.get_error()}")
        self._history.append((is_stop, counted))
        return True

    def _allows(self, token_id: int) -> bool:
        # validate_tokens does not count stop tokens; they are allowed exactly in accepting states
        if token_id in self._stop_token_ids:
            return self._inner.is_accepting()
        return self._inner.validate_tokens([token_id]) == 1

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        if self.is_terminated():
            fill_stop_only(bitmask, row, self._stop_token_ids)
        else:
            llguidance.torch.fill_next_token_bitmask(self._inner, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._history)} accepted tokens")
        if num_tokens:
            counted = sum(entry[1] for entry in self._history[-num_tokens:])
            if counted:
                self._inner.rollback(counted)
            del self._history[-num_tokens:]

    def is_terminated(self) -> bool:
        return bool(self._history) and self._history[-1][0]

    def find_jump_forward_string(self) -> str:
        if self.is_terminated():
            return ""
        return _utf8_prefix(self._inner.compute_ff_bytes())

    def copy(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(
            self._inner.deep_copy(), stop_token_ids=self._stop_token_ids, history=list(self._history)
        )

    @property
    def num_accepted(self) -> int:
        return len(self._history)


class LLGuidanceBackend(GrammarBackend):
    """Compiles by building (and validating) one prototype ``LLMatcher``; matchers are copies of it.

    Parameters
    ----------
    any_whitespace : bool
        Let JSON schemas allow any whitespace (otherwise the compact ``{"a": 1, "b": 2}`` layout).
    """

    name = "llguidance"

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        any_whitespace: bool = False,
    ) -> None:
        super().__init__(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._json_overrides = None if any_whitespace else _COMPACT_JSON
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=self.vocab_size, eos_token=list(self.stop_token_ids)
        )

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, self._grammar(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind.value} grammar: {_first_line(matcher.get_error())}")
        return matcher

    def _grammar(self, spec: GrammarSpec) -> str:
        """The llguidance grammar text of a spec."""
        if spec.kind is GrammarKind.JSON_SCHEMA:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=self._json_overrides)  # type: ignore[arg-type]
        if spec.kind is GrammarKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind is GrammarKind.EBNF:
            return llguidance.grammar_from("ebnf", spec.text)
        if spec.kind is GrammarKind.STRUCTURAL_TAG:
            lark = structural_tag_to_lark(normalize_structural_tag(spec.text))
            return llguidance.LLMatcher.grammar_from_lark(lark)
        return llguidance.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}', overrides=self._json_overrides  # type: ignore[arg-type]
        )

    def _new_matcher(self, handle: llguidance.LLMatcher) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(handle.deep_copy(), stop_token_ids=self.stop_token_ids, history=[])


def _utf8_prefix(data: bytes) -> str:
    """Decode the longest prefix of ``data`` that is complete UTF-8."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


def _first_line(message: str) -> str:
    return " ".join(message.strip().splitlines()[:3])[:500]
