"""Tool-call formats: parsing, streaming agreement, and the grammar that forces a call."""

from __future__ import annotations

import json
import random

import jsonschema
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
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["parameters"]}

# (format, response text) -> (normal text, [(name, arguments)]). Markup never reaches the text: a
# block that is not a call, or a call cut short, is dropped; so is whitespace that only separates
# calls from each other or from the ends of the response.
CASES = {
    ("qwen", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'): (
        "Sure.",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "qwen",
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": [1]}}\n</tool_call>',
    ): ("", [("a", {}), ("b", {"x": [1]})]),
    ("qwen", "no calls here, just <tool text and < signs"): (
        "no calls here, just <tool text and < signs",
        [],
    ),
    ("qwen", "  leading and trailing space  "): ("  leading and trailing space  ", []),
    ("qwen", "<tool_call>not json</tool_call> then text"): ("then text", []),
    ("qwen", 'unterminated <tool_call>\n{"name": "f", "arguments": {"k": "v"}}'): (
        "unterminated",
        [("f", {"k": "v"})],
    ),
    ("qwen", 'cut short <tool_call>{"name": "get_weather", "arguments": {"ci'): ("cut short", []),
    ("qwen", "unterminated garbage <tool_call> {"): ("unterminated garbage", []),
    ("qwen", 'A <tool_call>{"name": "f", "arguments": {}}</tool_call> B'): ("A  B", [("f", {})]),
    (
        "qwen",
        'same twice <tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>',
    ): (
        "same twice",
        [("f", {}), ("f", {})],
    ),
    ("qwen", '<tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>'): ("", [("f", {"q": 1})]),
    ("qwen", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'): ("", []),
    (
        "smollm2",
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]</tool_call>',
    ): ("", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("smollm2", 'Let me check. <tool_call>{"name": "get_time", "arguments": "{}"}</tool_call> done'): (
        "Let me check.  done",
        [("get_time", {})],
    ),
    ("smollm2", "plain answer"): ("plain answer", []),
    ("smollm2", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_t'): (
        "",
        [],
    ),
    ("smollm2", "<tool_call>[]</tool_call>"): ("", []),
    ("smollm2", "I think <tool_cal"): ("I think <tool_cal", []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Rome"}}'): (
        "",
        [("get_weather", {"city": "Rome"})],
    ),
    ("llama3", ' {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}'): (
        "",
        [("a", {}), ("b", {"y": 2})],
    ),
    ("llama3", '<|python_tag|>{"name": "a", "parameters": {"z": "\u00e9"}}'): ("", [("a", {"z": "\u00e9"})]),
    ("llama3", "The weather is {unknown}."): ("The weather is {unknown}.", []),
    ("llama3", "{not json at all"): ("{not json at all", []),
    ("llama3", '{"city": "Paris"}'): ('{"city": "Paris"}', []),
    ("llama3", '{"name": "get_weather", "parameters": {"ci'): ("", []),
    ("llama3", "<|python_tag|>oops"): ("", []),
    ("llama3", "<|python"): ("<|python", []),
    ("llama3", "   "): ("   ", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]'): (
        "",
        [("get_weather", {"city": "Rome"})],
    ),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"s": "]"}}]'): (
        "",
        [("a", {}), ("b", {"s": "]"})],
    ),
    ("mistral", 'Checking. [TOOL_CALLS] [{"name": "a", "arguments": {}}] Then more.'): (
        "Checking.  Then more.",
        [("a", {})],
    ),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"ci'): ("", []),
    ("mistral", "[TOOL_CALLS] nope"): ("nope", []),
    ("mistral", "just [TOOL text"): ("just [TOOL text", []),
}


def _parsed(text, fmt):
    normal, calls = parse_tool_calls(text, format=fmt)
    return normal, [(c.name, json.loads(c.arguments)) for c in calls], [c.index for c in calls]


@pytest.mark.parametrize("fmt", sorted(TOOL_CALL_FORMATS))
def test_every_format_has_cases(fmt):
    assert sum(1 for f, _ in CASES if f == fmt) >= 5


@pytest.mark.parametrize("key", sorted(CASES), ids=lambda k: f"{k[0]}:{k[1][:30]}")
def test_parse_tool_calls(key):
    fmt, text = key
    normal, calls, indexes = _parsed(text, fmt)
    assert (normal, calls) == CASES[key]
    assert indexes == list(range(len(calls)))


def _stream(fmt, pieces):
    parser = get_tool_call_format(fmt).streaming_parser()
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(o[0] for o in outs), merge_deltas([d for o in outs for d in o[1]])


@pytest.mark.parametrize("key", sorted(CASES), ids=lambda k: f"{k[0]}:{k[1][:30]}")
def test_streaming_agrees_at_every_split(key):
    """Two pieces split at every boundary, and one character at a time."""
    fmt, text = key
    expected = parse_tool_calls(text, format=fmt)
    for at in range(len(text) + 1):
        assert _stream(fmt, [text[:at], text[at:]]) == expected, at
    assert _stream(fmt, list(text)) == expected


@pytest.mark.parametrize("fmt", sorted(TOOL_CALL_FORMATS))
@pytest.mark.parametrize("seed", range(10))
def test_streaming_agrees_with_random_chunks(fmt, seed):
    rng = random.Random(seed)
    for f, text in CASES:
        if f != fmt:
            continue
        pieces, at = [], 0
        while at < len(text):
            size = rng.choice([1, 1, 2, 3, 5, 8, 13])
            pieces.append(text[at : at + size])
            at += size
        assert _stream(fmt, pieces) == parse_tool_calls(text, format=fmt)


@pytest.mark.parametrize("fmt", sorted(TOOL_CALL_FORMATS))
def test_render_parses_back(fmt):
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    form = get_tool_call_format(fmt)
    normal, parsed = form.parse(form.render(calls))
    assert normal == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    assert form.render(calls[:1]) in form.tools_prompt([WEATHER]).replace(
        "function_name", "get_weather"
    ).replace('{"argument": "value"}', '{"city": "Paris"}')


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
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
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
