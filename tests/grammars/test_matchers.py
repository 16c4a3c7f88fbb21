"""Matcher behaviour tables on every backend, driven by the real tokenizer (no model)."""

from __future__ import annotations

import json

import pytest
from phloem.grammars import GrammarError, GrammarKind, GrammarSpec
from phloem.grammars.jump_forward import jump_forward, retokenize_boundary

from .grammar_fake_model import STOP_TOKEN_IDS, VOCAB_SIZE, allowed_tokens

OBJ = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
)

# (kind, grammar, valid text, invalid text)
ACCEPT_TABLE = [
    ("regex", r"(yes|no)[0-9]{2}", "yes42", "maybe"),
    ("regex", r"[a-z]+@[a-z]+\.com", "bob@mail.com", "bob@@"),
    ("regex", r"-?(0|[1-9][0-9]*)", "-120", "01"),
    ("json_schema", OBJ, '{"name": "Ann", "age": 7}', '{"nam": 1}'),
    ("json_schema", json.dumps({"enum": ["alpha", "beta"]}), '"beta"', '"gamma"'),
    ("json_object", "", '{"k": [1, {"x": null}]}', "[1]"),
    ("ebnf", 'root ::= "a" root | "b"', "aaab", "ba"),
]

# (kind, grammar, prefix, expected jump-forward text)
JUMP_TABLE = [
    ("regex", r"hello world [0-9]", "", "hello world "),
    ("regex", r"(abc|abd)xyz", "ab", ""),
    ("regex", r"(abc|abd)xyz", "abc", "xyz"),
    ("json_schema", json.dumps({"const": "fixed"}), "", '"fixed"'),
]


def _spec(kind: str, text: str) -> GrammarSpec:
    return GrammarSpec(GrammarKind(kind), text)


# compiled grammars are immutable (each matcher has its own state): the tables share them, which
# matters for outlines' json_object (seconds to build)
_COMPILED: dict[tuple[str, str, str], object] = {}


def _compile_or_skip(backend, kind: str, text: str):
    if GrammarKind(kind) not in backend.supported_kinds:
        pytest.skip(f"{backend.name} has no {kind} support (regular languages only)")
    key = (backend.name, kind, text)
    if key not in _COMPILED:
        _COMPILED[key] = backend.compile(_spec(kind, text))
    return _COMPILED[key]


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("kind,grammar,valid,invalid", ACCEPT_TABLE)
def test_valid_string_terminates(backend, tokenizer, kind, grammar, valid, invalid):
    matcher = backend.new_matcher(_compile_or_skip(backend, kind, grammar))
    for token in _encode(tokenizer, valid):
        assert not matcher.is_terminated()
        assert matcher.accept_token(token), tokenizer.decode([token])
    assert set(STOP_TOKEN_IDS) <= set(allowed_tokens(matcher, backend.vocab_size).tolist())
    assert matcher.accept_token(STOP_TOKEN_IDS[0])
    assert matcher.is_terminated()
    assert not matcher.accept_token(_encode(tokenizer, "a")[0])


@pytest.mark.parametrize("kind,grammar,valid,invalid", ACCEPT_TABLE)
def test_invalid_string_rejected_without_state_change(backend, tokenizer, kind, grammar, valid, invalid):
    matcher = backend.new_matcher(_compile_or_skip(backend, kind, grammar))
    tokens = _encode(tokenizer, invalid)
    accepted = matcher.accept_tokens(tokens)
    assert accepted < len(tokens)
    before = allowed_tokens(matcher, backend.vocab_size)
    assert not matcher.accept_token(tokens[accepted])
    assert matcher.num_accepted == accepted
    assert (allowed_tokens(matcher, backend.vocab_size) == before).all()


@pytest.mark.parametrize("kind,grammar,valid,invalid", ACCEPT_TABLE)
def test_rollback_restores_mask_and_termination(backend, tokenizer, kind, grammar, valid, invalid):
    matcher = backend.new_matcher(_compile_or_skip(backend, kind, grammar))
    tokens = _encode(tokenizer, valid)
    masks = []
    for token in tokens:
        masks.append(allowed_tokens(matcher, backend.vocab_size))
        assert matcher.accept_token(token)
    assert matcher.accept_token(STOP_TOKEN_IDS[1])
    matcher.rollback(1)
    assert not matcher.is_terminated()
    for k in range(len(tokens), 0, -1):
        matcher.rollback(1)
        assert (allowed_tokens(matcher, backend.vocab_size) == masks[k - 1]).all()
    assert matcher.num_accepted == 0
    with pytest.raises(ValueError):
        matcher.rollback(1)
    assert matcher.accept_tokens(tokens) == len(tokens)


def test_copy_is_independent(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(_spec("regex", r"ab(c|d)")))
    matcher.accept_tokens(_encode(tokenizer, "ab"))
    twin = matcher.copy()
    assert twin.accept_token(_encode(tokenizer, "c")[0])
    assert twin.accept_token(STOP_TOKEN_IDS[0]) and twin.is_terminated()
    assert not matcher.is_terminated() and matcher.num_accepted == len(_encode(tokenizer, "ab"))
    assert matcher.accept_token(_encode(tokenizer, "d")[0])


def test_bitmask_allows_exactly_expected_tokens(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(_spec("regex", r"(cat|dog)s?")))
    first = set(allowed_tokens(matcher, backend.vocab_size).tolist())
    vocab = tokenizer.get_vocab()
    expected = {
        i for t, i in vocab.items() if t and any(w.startswith(t) for w in ("cat", "cats", "dog", "dogs"))
    }
    assert first == expected
    matcher.accept_tokens(_encode(tokenizer, "cat"))
    after = set(allowed_tokens(matcher, backend.vocab_size).tolist())
    assert after == {vocab["s"], *STOP_TOKEN_IDS}
    assert all(t < VOCAB_SIZE for t in after)  # ids past the tokenizer are never allowed


def test_terminated_mask_allows_only_stop_tokens(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(_spec("regex", "ok")))
    matcher.accept_tokens([*_encode(tokenizer, "ok"), STOP_TOKEN_IDS[0]])
    assert matcher.is_terminated()
    assert sorted(allowed_tokens(matcher, backend.vocab_size).tolist()) == sorted(STOP_TOKEN_IDS)


@pytest.mark.parametrize("kind,grammar,prefix,forced", JUMP_TABLE)
def test_jump_forward_string(backend, tokenizer, kind, grammar, prefix, forced):
    matcher = backend.new_matcher(backend.compile(_spec(kind, grammar)))
    assert matcher.accept_tokens(_encode(tokenizer, prefix)) == len(_encode(tokenizer, prefix))
    assert matcher.find_jump_forward_string() == forced


def test_jump_forward_applies_canonical_tokens(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(_spec("regex", r"\{\"name\": \"[a-z]+\"\}")))
    drop_k, new_ids = jump_forward(matcher, tokenizer, [])
    assert drop_k == 0 and tokenizer.decode(new_ids) == '{"name": "'
    assert new_ids == _encode(tokenizer, '{"name": "')
    assert matcher.num_accepted == len(new_ids)


def test_jump_forward_leaves_short_forced_runs_to_decoding(backend, tokenizer):
    """A forced run of fewer than ``min_tokens`` tokens is not applied; the matcher is untouched."""
    matcher = backend.new_matcher(backend.compile(_spec("regex", r"\{\"name\": \"[a-z]+\"\}")))
    forced = len(_encode(tokenizer, '{"name": "'))
    assert jump_forward(matcher, tokenizer, [], min_tokens=forced + 1) == (0, [])
    assert matcher.num_accepted == 0
    drop_k, new_ids = jump_forward(matcher, tokenizer, [], min_tokens=forced)
    assert (drop_k, len(new_ids)) == (0, forced) and matcher.num_accepted == forced


def test_jump_forward_stays_within_the_token_budget(backend, tokenizer):
    """A jump of forced text only is cut to ``max_tokens``; one that rewrote the tail is not taken
    when cut (its cut ids could spell less than the tokens they replace)."""
    matcher = backend.new_matcher(backend.compile(_spec("regex", r"\{\"name\": \"[a-z]+\"\}")))
    drop_k, new_ids = jump_forward(matcher, tokenizer, [], max_tokens=2)
    assert (drop_k, new_ids) == (0, _encode(tokenizer, '{"name": "')[:2]) and matcher.num_accepted == 2
    assert jump_forward(matcher, tokenizer, new_ids, max_tokens=0) == (0, [])

    matcher = backend.new_matcher(backend.compile(_spec("regex", r"Hello world!")))
    prev = _encode(tokenizer, "Hello wor")
    assert matcher.accept_tokens(prev) == len(prev)
    drop_k, new_ids = retokenize_boundary(tokenizer, prev, "ld!")
    assert drop_k > 0  # the tail is rewritten ("wor" + "ld" -> "world")
    added = len(new_ids) - drop_k
    assert jump_forward(matcher, tokenizer, prev, max_tokens=added - 1) == (0, [])
    assert matcher.num_accepted == len(prev) and matcher.find_jump_forward_string() == "ld!"
    assert jump_forward(matcher, tokenizer, prev, max_tokens=added) == (drop_k, new_ids)


def test_retokenize_boundary_merges_with_previous_tokens(tokenizer):
    prev = _encode(tokenizer, "Hello wor")
    drop_k, new_ids = retokenize_boundary(tokenizer, prev, "ld!")
    kept = prev[: len(prev) - drop_k]
    assert tokenizer.decode(kept + new_ids) == "Hello world!"
    assert kept + new_ids == _encode(tokenizer, "Hello world!")
    assert retokenize_boundary(tokenizer, prev, "") == (0, [])


def test_unsupported_kinds_raise_grammar_error(backends):
    outlines = backends["outlines"]
    for kind in ("ebnf", "structural_tag"):
        with pytest.raises(GrammarError, match="does not support"):
            outlines.compile(_spec(kind, 'root ::= "a"'))


def test_outlines_forced_text_is_computed_once_per_state(backends, tokenizer, monkeypatch):
    """Jump-forward asks each row's forced text after every launch: the DFA never changes, so the
    answer is kept per state and a second matcher in the same state reuses it."""
    compiled = backends["outlines"].compile(_spec("regex", r"\{\"name\": \"[a-z]+\"\}"))
    dfa = type(compiled.handle)
    calls = []
    real = dfa._forced_bytes
    monkeypatch.setattr(dfa, "_forced_bytes", lambda self, s: calls.append(s) or real(self, s))
    first, second = (backends["outlines"].new_matcher(compiled) for _ in range(2))
    assert first.find_jump_forward_string() == second.find_jump_forward_string() == '{"name": "'
    assert len(calls) == 1
