"""Tool calls and ``response_format`` through the official ``openai`` client against the real server.

Greedy decoding throughout, so the streamed and non-streamed runs of one request see the same tokens.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")

MAX_TOKENS = 64

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Current time in a timezone", "parameters": TIME_PARAMS},
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=180, max_retries=0)


def _create(client, **kwargs):
    kwargs = {"model": "default", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, **kwargs}
    return client.chat.completions.create(**kwargs)


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None, str]:
    """Merge streamed tool-call deltas by index: (calls, finish reason, content)."""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    ids: dict[int, str] = {}
    content, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.id:
                    ids[call.index] = call.id
                if call.function and call.function.name:
                    names[call.index] = call.function.name
                if call.function and call.function.arguments:
                    args[call.index] = args.get(call.index, "") + call.function.arguments
            finish = choice.finish_reason or finish
    assert set(ids) == set(names), "every streamed call needs an id with its name"
    return [(names[i], args.get(i, "")) for i in sorted(names)], finish, content


def _assert_valid(calls: list[tuple[str, str]]) -> None:
    assert calls, "expected at least one tool call"
    for name, arguments in calls:
        assert name in SCHEMAS, name
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# tool_choice -> extra request fields; each forces exactly one call, so the response ends by itself.
FORCED = {
    "named": {"tool_choice": NAMED},
    "required_one": {"tool_choice": "required", "parallel_tool_calls": False},
}


@pytest.mark.parametrize("forced", sorted(FORCED))
def test_forced_tool_call_validates_and_streams_the_same(client, forced):
    resp = _create(client, tools=TOOLS, **FORCED[forced])
    message = resp.choices[0].message
    calls = _calls(message)
    _assert_valid(calls)
    assert len(calls) == 1
    if forced == "named":
        assert calls[0][0] == "get_weather"
    assert resp.choices[0].finish_reason == "tool_calls"
    assert all(c.id and c.type == "function" for c in message.tool_calls)
    assert not message.content

    streamed, finish, content = _streamed_calls(_create(client, tools=TOOLS, stream=True, **FORCED[forced]))
    assert finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in streamed] == [(n, json.loads(a)) for n, a in calls]
    assert content == (message.content or "")


def test_required_with_parallel_calls_validates_and_reports_truncation(client):
    """Parallel calls may go on until ``max_tokens``: the complete calls validate, and a response cut
    short says ``length``, not ``tool_calls``."""
    resp = _create(client, tools=TOOLS, tool_choice="required", max_tokens=96)
    choice = resp.choices[0]
    _assert_valid(_calls(choice.message))
    truncated = resp.usage.completion_tokens == 96
    assert choice.finish_reason == ("length" if truncated else "tool_calls")


def test_tool_choice_none_gives_no_tool_calls(client):
    resp = _create(client, tools=TOOLS, tool_choice="none", max_tokens=16)
    message = resp.choices[0].message
    assert not message.tool_calls
    assert message.content
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_response_format_json_schema_strict(client):
    resp = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Describe John, who is 30 years old, as JSON."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "strict": True, "schema": PERSON},
        },
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_response_format_json_object(client):
    resp = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Reply with a JSON object with two keys, name and age, for John who is 30."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


def test_response_format_invalid_schema_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="default",
            messages=MESSAGES,
            max_tokens=8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "object", "properties": {"a": {"type": 12}}}},
            },
        )
    assert info.value.status_code == 400
    assert info.value.body and info.value.body.get("message")
