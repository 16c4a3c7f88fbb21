"""Hostile grammars: each yields a GrammarError or compiles quickly; never a crash or a stall."""

from __future__ import annotations

import json
import time

import pytest
from phloem.grammars import GrammarError, GrammarKind, GrammarSpec
from phloem.grammars.manager import GrammarManager, validate_spec

DEEP = 1000


def _deep_schema(depth: int) -> str:
    # Built as text: json.dumps of a 1,000-deep dict would itself recurse too deep.
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + "}}" * depth


HOSTILE = {
    "nul_in_regex": GrammarSpec(GrammarKind.REGEX, "ab\x00c"),
    "nul_in_schema": GrammarSpec(GrammarKind.JSON_SCHEMA, '{"const": "a\x00"}'),
    "schema_1000_deep": GrammarSpec(GrammarKind.JSON_SCHEMA, _deep_schema(DEEP)),
    "regex_1000_deep": GrammarSpec(GrammarKind.REGEX, "(" * DEEP + "a" + ")" * DEEP),
    "regex_10000_alternatives": GrammarSpec(GrammarKind.REGEX, "|".join(f"w{i}" for i in range(10_000))),
    "spec_over_1mb": GrammarSpec(GrammarKind.REGEX, "a" * (1 << 20) + "b"),
    "schema_not_json": GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": '),
    "schema_not_object": GrammarSpec(GrammarKind.JSON_SCHEMA, "[1, 2]"),
    "recursive_ref": GrammarSpec(
        GrammarKind.JSON_SCHEMA, json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})
    ),
    "mutual_recursive_ref": GrammarSpec(
        GrammarKind.JSON_SCHEMA,
        json.dumps({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    ),
    "dangling_ref": GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"$ref": "#/$defs/missing"})),
    "ebnf_left_recursion": GrammarSpec(GrammarKind.EBNF, 'root ::= root "a" | "b"'),
    "ebnf_syntax_error": GrammarSpec(GrammarKind.EBNF, "root ::= ("),
    "regex_huge_repeat": GrammarSpec(GrammarKind.REGEX, "(a{1000}){1000}"),
    "structural_tag_garbage": GrammarSpec(GrammarKind.STRUCTURAL_TAG, '{"type": "structural_tag"}'),
}

REJECTED_BEFORE_COMPILE = {
    "nul_in_regex",
    "nul_in_schema",
    "schema_1000_deep",
    "regex_1000_deep",
    "regex_10000_alternatives",
    "spec_over_1mb",
    "schema_not_json",
    "schema_not_object",
    "regex_huge_repeat",
}


@pytest.mark.parametrize("name", sorted(REJECTED_BEFORE_COMPILE))
def test_validate_spec_rejects(name):
    start = time.perf_counter()
    with pytest.raises(GrammarError):
        validate_spec(HOSTILE[name])
    assert time.perf_counter() - start < 1.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_spec_fails_or_compiles_fast(backend, name):
    manager = GrammarManager(backend, max_workers=1, compile_timeout=10.0)
    start = time.perf_counter()
    future = manager.submit(HOSTILE[name])
    try:
        compiled = future.result(timeout=15.0)
    except GrammarError as exc:
        assert str(exc)
    else:
        backend.new_matcher(compiled).fill_next_token_bitmask(_mask(backend), 0)
    assert time.perf_counter() - start < 12.0
    again = time.perf_counter()
    assert manager.submit(HOSTILE[name]) is future  # cached, success or failure
    assert time.perf_counter() - again < 0.05
    manager.shutdown()


def _mask(backend):
    from phloem.grammars.bitmask import allocate_bitmask

    return allocate_bitmask(1, backend.vocab_size)
