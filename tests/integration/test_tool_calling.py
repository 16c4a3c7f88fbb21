"""Tool calls and ``response_format`` through the official ``openai`` client against the real server.

Greedy decoding throughout, so the streamed and non-streamed runs of one request see the same tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import requests

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
        "function": {
            "name": "get_time",
            "description": "Current time in a timezone",
            "parameters": TIME_PARAMS,
        },
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
        messages=[
            {
                "role": "user",
                "content": "Reply with a JSON object with two keys, name and age, for John who is 30.",
            }
        ],
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
                "json_schema": {
                    "name": "bad",
                    "schema": {"type": "object", "properties": {"a": {"type": 12}}},
                },
            },
        )
    assert info.value.status_code == 400
    assert info.value.body and info.value.body.get("message")


# ---- streamed vs whole: one table, both ways, through the official client --------------------------
MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")
TOKYO_OSLO = [{"role": "user", "content": "What time is it in Tokyo, and what is the weather in Oslo?"}]
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 30},
                "limit": {"type": "integer", "minimum": 1, "maximum": 10},
                "tags": {"type": "array", "items": {"enum": ["news", "maps"]}, "maxItems": 2},
            },
            "required": ["query", "limit"],
            "additionalProperties": False,
        },
    },
}
PING = {"type": "function", "function": {"name": "ping", "description": "Check the service"}}
ALL_SCHEMAS = {
    **SCHEMAS,
    "search": SEARCH["function"]["parameters"],
    "ping": {"type": "object"},
}
ANSWERED = [
    {"role": "user", "content": "What is the weather like in Paris today?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": '{"temperature": 21, "sky": "clear"}'},
]
SYSTEM = [{"role": "system", "content": "You are a weather assistant."}, *MESSAGES]

STREAM_CASES = {
    "required": {"tools": TOOLS, "tool_choice": "required"},
    "required_one": {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
    "required_two_questions": {"tools": TOOLS, "tool_choice": "required", "messages": TOKYO_OSLO},
    "required_system": {"tools": TOOLS, "tool_choice": "required", "messages": SYSTEM},
    "required_one_tool": {"tools": TOOLS[:1], "tool_choice": "required"},
    "required_nested_schema": {
        "tools": [SEARCH],
        "tool_choice": "required",
        "messages": [{"role": "user", "content": "Find news about Mars."}],
    },
    "required_cut_5": {"tools": TOOLS, "tool_choice": "required", "max_tokens": 5},
    "required_cut_14": {"tools": TOOLS, "tool_choice": "required", "max_tokens": 14},
    "named_weather": {"tools": TOOLS, "tool_choice": NAMED},
    "named_time": {"tools": TOOLS, "tool_choice": NAMED_TIME, "messages": TOKYO_OSLO},
    "named_not_parallel": {"tools": TOOLS, "tool_choice": NAMED, "parallel_tool_calls": False},
    "named_no_parameters": {
        "tools": [*TOOLS, PING],
        "tool_choice": {"type": "function", "function": {"name": "ping"}},
    },
    "named_cut_9": {"tools": TOOLS, "tool_choice": NAMED, "max_tokens": 9},
    "auto": {"tools": TOOLS, "tool_choice": "auto"},
    "auto_default_choice": {"tools": TOOLS},
    "auto_two_questions": {"tools": TOOLS, "messages": TOKYO_OSLO},
    "auto_cut_6": {"tools": TOOLS, "max_tokens": 6},
    "auto_stop_sequence": {"tools": TOOLS, "stop": ["."]},
    "none": {"tools": TOOLS, "tool_choice": "none"},
    "none_cut_4": {"tools": TOOLS, "tool_choice": "none", "max_tokens": 4},
    "no_tools": {},
    "tool_result_auto": {"tools": TOOLS, "messages": ANSWERED},
    "tool_result_required": {"tools": TOOLS, "tool_choice": "required", "messages": ANSWERED},
    "history_without_tools": {"messages": ANSWERED, "max_tokens": 24},
    "two_choices": {"tools": TOOLS, "tool_choice": "required", "n": 2},
}


def _whole(resp) -> list[dict]:
    return [
        {
            "content": c.message.content or "",
            "calls": [
                (t.id, t.type, t.function.name, t.function.arguments) for t in c.message.tool_calls or []
            ],
            "finish": c.finish_reason,
        }
        for c in resp.choices
    ]


def _reassembled(stream, n: int) -> list[dict]:
    """Each choice rebuilt from its deltas, as a client would; checks the delta shapes on the way."""
    content = [""] * n
    calls: list[dict[int, list]] = [{} for _ in range(n)]
    finish: list[str | None] = [None] * n
    for chunk in stream:
        for choice in chunk.choices:
            i = choice.index
            assert finish[i] is None, "no delta after the finish reason"
            content[i] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:  # the first delta of a call carries id, type and name
                    assert call.index not in calls[i] and call.function.name
                    calls[i][call.index] = [call.id, call.type, call.function.name, ""]
                calls[i][call.index][3] += call.function.arguments or ""
            finish[i] = choice.finish_reason
    return [
        {"content": content[i], "calls": [tuple(calls[i][k]) for k in sorted(calls[i])], "finish": finish[i]}
        for i in range(n)
    ]


def _without_ids(choices: list[dict]) -> list[dict]:
    return [{**c, "calls": [call[1:] for call in c["calls"]]} for c in choices]


@pytest.mark.parametrize("case", sorted(STREAM_CASES))
def test_streamed_reassembles_to_whole(client, case):
    kwargs = dict(STREAM_CASES[case])
    n = kwargs.get("n", 1)
    max_tokens = kwargs.setdefault("max_tokens", 48)
    resp = _create(client, **kwargs)
    whole = _whole(resp)
    assert _without_ids(_reassembled(_create(client, stream=True, **kwargs), n)) == _without_ids(whole)

    forced = kwargs.get("tool_choice") == "required" or isinstance(kwargs.get("tool_choice"), dict)
    for choice in whole:
        assert not any(m in choice["content"] for m in MARKUP), choice
        assert all(CALL_ID.match(c[0]) and c[1] == "function" for c in choice["calls"])
        if choice["finish"] == "length":
            assert resp.usage.completion_tokens == max_tokens * n
        else:
            assert choice["finish"] == ("tool_calls" if choice["calls"] else "stop")
        for _, _, name, arguments in choice["calls"]:
            assert name in {t["function"]["name"] for t in kwargs["tools"]}
            if forced:  # decoding followed the schemas
                jsonschema.validate(json.loads(arguments), ALL_SCHEMAS[name])
        if forced and choice["finish"] != "length":
            assert choice["calls"], "a forced call was made"
            assert not choice["content"]
        if isinstance(kwargs.get("tool_choice"), dict):
            assert {c[2] for c in choice["calls"]} <= {kwargs["tool_choice"]["function"]["name"]}
        if kwargs.get("parallel_tool_calls") is False:
            assert len(choice["calls"]) <= 1
        if kwargs.get("tool_choice") == "none" or "tools" not in kwargs:
            assert not choice["calls"]


def test_cut_call_reports_length_and_no_half_call(client):
    resp = _create(client, tools=TOOLS, tool_choice="required", max_tokens=10)
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls
    assert not choice.message.content


def test_forced_call_without_tools_is_rejected(client):
    with pytest.raises(openai.BadRequestError) as info:
        _create(client, tool_choice="required", max_tokens=4)
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        _create(
            client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}, max_tokens=4
        )
    assert info.value.body["param"] == "tool_choice" and "nope" in info.value.body["message"]


# ---- POST /parse_function_call ---------------------------------------------------------------------
def test_parse_function_call_route(server):
    text = 'Checking. <tool_call>[{"name": "get_time", "arguments": {"timezone": "UTC"}}]</tool_call>'
    body = {"text": text, "tool_call_parser": "smollm2", "tools": TOOLS}
    resp = requests.post(server.url + "/parse_function_call", json=body, timeout=30)
    assert resp.status_code == 200
    assert resp.json() == {
        "normal_text": "Checking.",
        "calls": [{"name": "get_time", "parameters": '{"timezone": "UTC"}', "tool_index": 1}],
    }
    sglang_name = {
        "text": '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
        "tool_call_parser": "qwen25",
        "tools": TOOLS,
    }
    calls = requests.post(server.url + "/parse_function_call", json=sglang_name, timeout=30).json()["calls"]
    assert [(c["name"], c["tool_index"]) for c in calls] == [("get_weather", 0)]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tool_call_parser": "qwen", "tools": []}, "text"),
        ({"text": 3, "tool_call_parser": "qwen", "tools": []}, "text"),
        ({"text": "x", "tools": []}, "tool_call_parser"),
        ({"text": "x", "tool_call_parser": "nope", "tools": []}, "tool_call_parser"),
        ({"text": "x", "tool_call_parser": "qwen"}, "tools"),
        ({"text": "x", "tool_call_parser": "qwen", "tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_parse_function_call_bad_input(server, body, field):
    resp = requests.post(server.url + "/parse_function_call", json=body, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == field
    assert field in resp.json()["error"]["message"]
