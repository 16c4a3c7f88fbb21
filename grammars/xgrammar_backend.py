"""Grammar backend over xgrammar (the default): all five grammar kinds."""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from typing import Any

import torch
import xgrammar as xgr

from .base import GrammarBackend, GrammarKind, GrammarMatcher, GrammarSpec, fill_stop_only
from .structural_tag import normalize_structural_tag


def builtin_json_object_ebnf() -> str:
    """The EBNF grammar of any JSON object shipped in ``assets/``."""
    return resources.files(__package__).joinpath("assets/json_object.ebnf").read_text()


class XGrammarMatcher(GrammarMatcher):
    """Matcher over ``xgrammar.GrammarMatcher``; counts accepted tokens for rollback."""

    def __init__(self, inner: xgr.GrammarMatcher, *, stop_token_ids: Sequence[int], accepted: int = 0):
        self._inner = inner
        self._stop_token_ids = tuple(stop_token_ids)
        self._accepted = accepted

    def accept_token(self, token_id: int) -> bool:
        if self._inner.is_terminated() or not self._inner.accept_token(int(token_id)):
            return False
        self._accepted += 1
        return True

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        if self._inner.is_terminated():
            fill_stop_only(bitmask, row, self._stop_token_ids)
        else:
            self._inner.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self._accepted} accepted tokens")
        if num_tokens:
            self._inner.rollback(num_tokens)
            self._accepted -= num_tokens

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()

    def find_jump_forward_string(self) -> str:
        return "" if self._inner.is_terminated() else self._inner.find_jump_forward_string()

    def copy(self) -> XGrammarMatcher:
        return XGrammarMatcher(
            self._inner.fork(), stop_token_ids=self._stop_token_ids, accepted=self._accepted
        )

    @property
    def num_accepted(self) -> int:
        return self._accepted


class XGrammarBackend(GrammarBackend):
    """Compiles with ``xgrammar.GrammarCompiler`` (its own cache disabled: the manager caches).

    Parameters
    ----------
    max_threads : int
        Threads xgrammar may use inside one compile.
    any_whitespace : bool
        Let JSON schemas allow any whitespace between tokens (otherwise one fixed layout,
        ``{"a": 1, "b": 2}``, which keeps small models from rambling in whitespace).
    """

    name = "xgrammar"

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_threads: int = 2,
        any_whitespace: bool = False,
    ) -> None:
        super().__init__(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids)
        )
        self._any_whitespace = any_whitespace
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind is GrammarKind.JSON_SCHEMA:
            return self._compiler.compile_json_schema(spec.text, any_whitespace=self._any_whitespace)
        if spec.kind is GrammarKind.REGEX:
            return self._compiler.compile_regex(spec.text)
        if spec.kind is GrammarKind.EBNF:
            return self._compiler.compile_grammar(spec.text)
        if spec.kind is GrammarKind.STRUCTURAL_TAG:
            tag = normalize_structural_tag(spec.text)
            return self._compiler.compile_structural_tag(json.dumps(tag))
        return self._compiler.compile_grammar(builtin_json_object_ebnf())

    def _new_matcher(self, handle: xgr.CompiledGrammar) -> XGrammarMatcher:
        inner = xgr.GrammarMatcher(handle, override_stop_tokens=list(self.stop_token_ids))
        return XGrammarMatcher(inner, stop_token_ids=self.stop_token_ids)
