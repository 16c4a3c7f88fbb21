"""Tool-call formats: parsing, streaming agreement, and the grammar that forces a call."""

from __future__ import annotations

import json
import random

import pytest
from phloem.grammars import GrammarError
from phloem.grammars.tools import (
    TOOL_CALL_FORMATS,
    get_tool_call_format,
    merge_deltas,
    parse_tool_calls,
    structural_tag_for,
)

from .grammar_fake_model import STOP_TOKEN_IDS, TokenClasses, sample_output

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}

SAMPLES = {
    "qwen": [
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": [1]}}\n</tool_call>',
        "no calls here, just <tool text and < signs",
        "<tool_call>not json</tool_call> then text",
        'unterminated <tool_call>\n{"name": "f", "arguments": {"k": "v"}}',
        "unterminated garbage <tool_call> {",
    ],
    "smollm2": [
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]</tool_call>',
        'Let me check. <tool_call>{"name": "get_time", "arguments": "{}"}</tool_call> done',
        "plain answer",
    ],
    "llama3": [
        '{"name": "get_weather", "parameters": {"city": "Rome"}}',
        ' {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}',
        "The weather is {unknown}.",
        "{not json at all",
    ],
}

EXPECTED = {
    ("qwen", 0): ("Sure.\n", [("get_weather", {"city": "Paris"})]),
    ("qwen", 1): ("\n", [("a", {}), ("b", {"x": [1]})]),
    ("qwen", 3): ("<tool_call>not json</tool_call> then text", []),
    ("qwen", 4): ("unterminated ", [("f", {"k": "v"})]),
    ("smollm2", 0): ("", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("smollm2", 1): ("Let me check.  done", [("get_time", {})]),
    ("llama3", 1): (" ", [("a", {}), ("b", {"y": 2})]),
    ("llama3", 3): ("{not json at all", []),
}


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_parse_tool_calls(key):
    fmt, i = key
    text, calls = parse_tool_calls(SAMPLES[fmt][i], format=fmt)
    want_text, want_calls = EXPECTED[key]
    assert text == want_text
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls
    assert [c.index for c in calls] == list(range(len(calls)))


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
@pytest.mark.parametrize("seed", range(25))
def test_streaming_agrees_with_full_parse(fmt, seed):
    rng = random.Random(seed)
    for text in SAMPLES[fmt]:
        expected = parse_tool_calls(text, format=fmt)
        parser = get_tool_call_format(fmt).streaming_parser()
        pieces, deltas, at = [], [], 0
        while at < len(text):
            size = rng.choice([1, 1, 2, 3, 5, 8, 13])
            out, calls = parser.feed(text[at : at + size])
            pieces.append(out)
            deltas += calls
            at += size
        out, calls = parser.finish()
        pieces.append(out)
        deltas += calls
        assert ("".join(pieces), merge_deltas(deltas)) == expected


def test_structural_tag_for_choices():
    assert structural_tag_for([WEATHER], "auto") is None
    assert structural_tag_for([WEATHER], "none") is None
    spec = structural_tag_for([WEATHER, TIME], "required")
    assert spec is not None and json.loads(spec.text)["format"]["at_least_one"]
    named = structural_tag_for([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert "get_time" in named.text and "get_weather" not in named.text
    with pytest.raises(ValueError):
        structural_tag_for([WEATHER], {"type": "function", "function": {"name": "nope"}})


TAGGING_BACKENDS = ("xgrammar", "llguidance")


@pytest.mark.parametrize("backend_name", TAGGING_BACKENDS)
@pytest.mark.parametrize("fmt", sorted(TOOL_CALL_FORMATS))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_parse(backends, tokenizer, backend_name, fmt, choice):
    backend = backends[backend_name]
    compiled = backend.compile(structural_tag_for([WEATHER, TIME], choice, format=fmt))
    classes = TokenClasses.from_tokenizer(tokenizer, len(tokenizer))
    done = 0
    for seed in range(3):
        ids, terminated = sample_output(
            backend.new_matcher(compiled),
            vocab_size=backend.vocab_size,
            stop_token_ids=STOP_TOKEN_IDS,
            classes=classes,
            seed=seed,
            max_tokens=200,
        )
        if not terminated:
            continue
        done += 1
        text, calls = parse_tool_calls(tokenizer.decode(ids), format=fmt)
        assert calls and text.strip(" ;\n") == "", tokenizer.decode(ids)
        for call in calls:
            assert call.name in ("get_weather", "get_time")
        if isinstance(choice, dict):
            assert [c.name for c in calls] == ["get_weather"]
    assert done


def test_outlines_rejects_structural_tags(backends):
    with pytest.raises(GrammarError):
        backends["outlines"].compile(structural_tag_for([WEATHER], "required"))


@pytest.mark.parametrize("backend_name", TAGGING_BACKENDS)
def test_legacy_structural_tag_and_triggers(backends, tokenizer, backend_name):
    backend = backends[backend_name]
    legacy = {
        "structures": [
            {
                "begin": "<f>",
                "schema": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}},
                    "required": ["x"],
                    "additionalProperties": False,
                },
                "end": "</f>",
            }
        ],
        "triggers": ["<f>"],
    }
    from phloem.grammars import GrammarSpec

    matcher = backend.new_matcher(backend.compile(GrammarSpec("structural_tag", json.dumps(legacy))))
    text = 'Hello there <f>{"x": 3}</f> bye'
    assert matcher.accept_tokens(tokenizer.encode(text)) == len(tokenizer.encode(text))
    assert matcher.accept_token(STOP_TOKEN_IDS[0])
    bad = backend.new_matcher(backend.compile(GrammarSpec("structural_tag", json.dumps(legacy))))
    ids = tokenizer.encode('Hi <f>{"y": 3}</f>')
    assert bad.accept_tokens(ids) < len(ids)
