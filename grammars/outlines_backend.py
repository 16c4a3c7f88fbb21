"""Grammar backend over outlines-core: regular languages only (regex, JSON schema, JSON object).

A JSON schema becomes a regex (``outlines_core.json_schema.build_regex_from_schema``) and a regex
becomes a token-level DFA (``outlines_core.Index``). The matcher keeps its own stack of DFA states,
which gives rollback and termination; EBNF and structural tags need a context-free parser and are
rejected with a :class:`GrammarError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import outlines_core
import torch
from outlines_core.json_schema import build_regex_from_schema

from .automaton import TokenAutomaton, build_automaton
from .base import GrammarBackend, GrammarKind, GrammarMatcher, GrammarSpec, fill_stop_only
from .regular import ascii_shorthands

_TERMINATED = -1  # pseudo-state pushed when a stop token is accepted
_MAX_JUMP_STEPS = 256


@dataclass
class _OutlinesGrammar:
    """A compiled DFA plus per-state masks computed on first use (shared by matchers)."""

    index: outlines_core.Index
    token_bytes: list[bytes | None]
    stop_token_ids: tuple[int, ...]
    num_words: int
    first_bytes: np.ndarray  # [V] int16: each token's first byte, -1 for none (``first_byte_table``)
    masks: dict[int, np.ndarray] = field(default_factory=dict)
    automaton: TokenAutomaton | None = None  # the same DFA as device tables, when asked for
    # state -> (the common byte prefix of its allowed tokens, a token spelling exactly that prefix)
    prefixes: dict[int, tuple[bytes, int | None]] = field(default_factory=dict)
    forced: dict[int, bytes] = field(default_factory=dict)  # state -> its forced text

    def mask(self, state: int) -> np.ndarray:
        """The int32 mask row of a DFA state (cached)."""
        row = self.masks.get(state)
        if row is None:
            row = self._build_mask(state)
            self.masks[state] = row
        return row

    def _build_mask(self, state: int) -> np.ndarray:
        allowed = np.asarray(self.index.get_allowed_tokens(state) or [], dtype=np.int64)
        allowed = allowed[np.isin(allowed, self.stop_token_ids, invert=True)]
        if self.index.is_final_state(state):
            allowed = np.concatenate([allowed, np.asarray(self.stop_token_ids, dtype=np.int64)])
        bits = np.zeros(self.num_words * 32, dtype=np.uint8)
        bits[allowed] = 1
        return np.packbits(bits, bitorder="little").view(np.int32)

    def common_prefix(self, state: int) -> tuple[bytes, int | None]:
        """Longest common byte prefix of the tokens ``state`` allows (stop tokens aside), and a
        token spelling exactly that prefix (cached per state; the DFA never changes). Asked after
        every token under jump-forward, so a state whose tokens start with different bytes (most
        of them: inside a string, every token is allowed) is answered without a Python loop."""
        found = self.prefixes.get(state)
        if found is None:
            found = self.prefixes[state] = self._common_prefix(state)
        return found

    def _common_prefix(self, state: int) -> tuple[bytes, int | None]:
        allowed = self._allowed(state)
        if allowed.size == 0:
            return b"", None
        first = self.first_bytes[allowed]
        if first[0] < 0 or (first != first[0]).any():
            return b"", None  # an empty spelling, or two first bytes: nothing in common
        spellings = {int(t): self.token_bytes[t] or b"" for t in allowed}
        lo, hi = min(spellings.values()), max(spellings.values())
        size = next((i for i, (a, b) in enumerate(zip(lo, hi)) if a != b), min(len(lo), len(hi)))
        prefix = lo[:size]
        exact = next((t for t, sp in spellings.items() if sp == prefix), None) if prefix else None
        return prefix, exact

    def forced_bytes(self, state: int) -> bytes:
        """The text ``state`` forces: the common prefix of every allowed token, extended while
        that prefix is itself a token (empty in a final state, where the output may end). Cached
        per state: under jump-forward it is asked after every launch, for every row."""
        found = self.forced.get(state)
        if found is None:
            found = self.forced[state] = self._forced_bytes(state)
        return found

    def _forced_bytes(self, state: int) -> bytes:
        forced = b""
        for _ in range(_MAX_JUMP_STEPS):
            if state == _TERMINATED or self.index.is_final_state(state):
                break
            prefix, exact = self.common_prefix(state)
            forced += prefix
            if exact is None:
                break
            state = self.index.get_next_state(state, exact)
        return forced

    def _allowed(self, state: int) -> np.ndarray:
        """The ordinary tokens ``state`` allows (from the automaton's sorted keys when it is built)."""
        a = self.automaton
        if a is not None:
            local = a.local(state)
            lo, hi = np.searchsorted(a.keys, [local * a.vocab_size, (local + 1) * a.vocab_size])
            tokens = a.keys[lo:hi] - local * a.vocab_size
            tokens = tokens[a.targets[lo:hi] >= 0]  # stop tokens lead out of the automaton
        else:
            tokens = np.asarray(self.index.get_allowed_tokens(state) or [], dtype=np.int64)
        return tokens[np.isin(tokens, self.stop_token_ids, invert=True)]

    def next_state(self, state: int, token_id: int) -> int | None:
        """The state after ``token_id``, ``_TERMINATED`` for an allowed stop token, else None."""
        if token_id in self.stop_token_ids:
            return _TERMINATED if self.index.is_final_state(state) else None
        if not 0 <= token_id < len(self.token_bytes) or self.token_bytes[token_id] is None:
            return None
        return self.index.get_next_state(state, token_id)


class OutlinesMatcher(GrammarMatcher):
    """Matcher over an outlines-core DFA; ``states[-1]`` is the current state."""

    def __init__(self, grammar: _OutlinesGrammar, states: list[int]):
        self._grammar = grammar
        self._states = states

    def accept_token(self, token_id: int) -> bool:
        if self.is_terminated():
            return False
        state = self._grammar.next_state(self._states[-1], int(token_id))
        if state is None:
            return False
        self._states.append(state)
        return True

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        if self.is_terminated():
            fill_stop_only(bitmask, row, self._grammar.stop_token_ids)
            return
        bitmask[row].copy_(torch.from_numpy(self._grammar.mask(self._states[-1])))

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} accepted tokens")
        if num_tokens:
            del self._states[-num_tokens:]

    def is_terminated(self) -> bool:
        return self._states[-1] == _TERMINATED

    def find_jump_forward_string(self) -> str:
        return self._grammar.forced_bytes(self._states[-1]).decode("utf-8", errors="ignore")

    def copy(self) -> OutlinesMatcher:
        return OutlinesMatcher(self._grammar, list(self._states))

    @property
    def automaton(self) -> TokenAutomaton | None:
        """The compiled grammar's device automaton, if it was built."""
        return self._grammar.automaton

    def automaton_state(self) -> int:
        """The current state as a local id of :attr:`automaton` (-1 once terminated)."""
        assert self._grammar.automaton is not None
        state = self._states[-1]
        return -1 if state == _TERMINATED else self._grammar.automaton.local(state)

    @property
    def num_accepted(self) -> int:
        return len(self._states) - 1


class OutlinesBackend(GrammarBackend):
    """Compiles regexes (and JSON schemas via regexes) into outlines-core token DFAs.

    Parameters
    ----------
    whitespace_pattern : str | None
        Regex for the whitespace a JSON schema allows between tokens (outlines' default if None).
    max_recursion_depth : int
        How deep recursive ``$ref`` schemas are unrolled into the regex.
    build_automata : bool
        Also build each grammar's :class:`~phloem.grammars.automaton.TokenAutomaton` (for masks
        on the device); a DFA too large for it fails the compile with a ``GrammarError``.
    canonical_forced_text : bool
        With ``build_automata``: in every state that forces text of two tokens or more, the
        device mask allows only the first token of the text's own tokenization
        (:func:`canonical_forced_tokens`), so a row decoding on the device spells forced text
        as jump-forward would, in fewer tokens than a model choosing among its spellings.
    """

    name = "outlines"
    supported_kinds = frozenset({GrammarKind.JSON_SCHEMA, GrammarKind.REGEX, GrammarKind.JSON_OBJECT})

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        whitespace_pattern: str | None = None,
        max_recursion_depth: int = 3,
        build_automata: bool = False,
        canonical_forced_text: bool = False,
    ) -> None:
        super().__init__(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._build_automata = build_automata
        self._canonical_forced = canonical_forced_text
        self._whitespace = whitespace_pattern
        self._max_depth = max_recursion_depth
        self._token_bytes = token_bytes_table(tokenizer, vocab_size=self.vocab_size)
        self._first_bytes = first_byte_table(self._token_bytes)
        self._vocabulary = _build_vocabulary(self._token_bytes, self.stop_token_ids)

    def _compile(self, spec: GrammarSpec) -> _OutlinesGrammar:
        index = outlines_core.Index(self._regex(spec), self._vocabulary)
        automaton = None
        if self._build_automata:
            automaton = build_automaton(index, stop_token_ids=self.stop_token_ids, vocab_size=self.vocab_size)
        grammar = _OutlinesGrammar(
            index=index,
            token_bytes=self._token_bytes,
            stop_token_ids=self.stop_token_ids,
            num_words=(self.vocab_size + 31) // 32,
            first_bytes=self._first_bytes,
            automaton=automaton,
        )
        if automaton is not None and self._canonical_forced:
            grammar.automaton = automaton.forcing(canonical_forced_tokens(grammar, self.tokenizer))
        if grammar.automaton is not None:
            # the scheduler reads both bounds per request: computed here, on the compile thread,
            # not in the scheduler's loop when the first request of the grammar runs
            grammar.automaton.steps_to_stop, grammar.automaton.longest_to_stop  # noqa: B018
        return grammar

    def _regex(self, spec: GrammarSpec) -> str:
        """The regex to index; ``\\d``, ``\\w`` and ``\\s`` keep their ASCII meaning (as in the
        other backends and JSON Schema), which outlines-core would widen to Unicode."""
        if spec.kind is GrammarKind.REGEX:
            return ascii_shorthands(spec.text)
        text = spec.text if spec.kind is GrammarKind.JSON_SCHEMA else '{"type": "object"}'
        return ascii_shorthands(build_regex_from_schema(text, self._whitespace, self._max_depth))

    def _new_matcher(self, handle: _OutlinesGrammar) -> OutlinesMatcher:
        return OutlinesMatcher(handle, [handle.index.get_initial_state()])


def canonical_forced_tokens(grammar: _OutlinesGrammar, tokenizer: Any) -> np.ndarray:
    """Per local state of ``grammar.automaton``, the first token of the tokenizer's own encoding
    of the text the state forces, where that text takes two tokens or more (-1 elsewhere).

    One token is left to the model: a state forcing a single token's worth of text (an opening
    quote) may also allow tokens that run on into free text (a quote and a word), and narrowing
    it would split those. The token must spell a prefix of the forced text and be a transition
    of the state (it is, unless the encoding merged across characters the DFA splits).
    """
    automaton = grammar.automaton
    assert automaton is not None
    forced = np.full(automaton.num_states, -1, dtype=np.int32)
    for local, state in enumerate(automaton.state_ids.tolist()):
        text = grammar.forced_bytes(state)
        if not text:
            continue
        ids = tokenizer.encode(text.decode("utf-8", errors="ignore"), add_special_tokens=False)
        if len(ids) < 2:
            continue
        piece = grammar.token_bytes[ids[0]] if ids[0] < len(grammar.token_bytes) else None
        if piece and text.startswith(piece) and automaton.next_local(local, ids[0]) is not None:
            forced[local] = ids[0]
    return forced


def token_bytes_table(tokenizer: Any, *, vocab_size: int) -> list[bytes | None]:
    """The bytes each token id spells; None for special tokens and ids the tokenizer lacks.

    Handles byte-level BPE (GPT-2 style ``Ġ`` alphabet) and SentencePiece (``▁``, ``<0xNN>``).
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    unicode_to_byte = {u: b for b, u in bytes_to_unicode().items()}
    special = {t for t, tok in tokenizer.added_tokens_decoder.items() if tok.special}
    table: list[bytes | None] = [None] * vocab_size
    for piece, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special:
            table[token_id] = _piece_bytes(piece, unicode_to_byte)
    return table


def first_byte_table(table: Sequence[bytes | None]) -> np.ndarray:
    """Each token's first byte (int16), -1 where it spells nothing."""
    return np.array([piece[0] if piece else -1 for piece in table], dtype=np.int16)


def _piece_bytes(piece: str, unicode_to_byte: dict[str, int]) -> bytes:
    """Bytes of one vocabulary piece."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    if all(ch in unicode_to_byte for ch in piece):
        return bytes(unicode_to_byte[ch] for ch in piece)
    return piece.replace("\u2581", " ").encode("utf-8")


def _build_vocabulary(table: list[bytes | None], stop_token_ids: tuple[int, ...]) -> outlines_core.Vocabulary:
    """An outlines-core vocabulary of every ordinary token (stop tokens handled by the matcher)."""
    pieces: dict[bytes, list[int]] = {}
    for token_id, piece in enumerate(table):
        if piece and token_id not in stop_token_ids:
            pieces.setdefault(piece, []).append(token_id)
    return outlines_core.Vocabulary(stop_token_ids[0], pieces)
