"""The chat route's tool-call hook: format choice, prompts for templates without tools, and
``POST /parse_function_call`` on a fake server."""

from __future__ import annotations

import json

import pytest
from phloem.runtime.server.tool_calls import load_parser, template_renders_tools, tool_call_format

from .test_server_fake_tm import make_client

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time"}},
]


@pytest.mark.parametrize(
    ("info", "fmt"),
    [
        ({"tool_call_format": "mistral", "served_model_name": "SmolLM2"}, "mistral"),
        ({"served_model_name": "SmolLM2-135M-Instruct"}, "smollm2"),
        ({"model_path": "/m/Meta-Llama-3.1-8B-Instruct.gguf"}, "llama3"),
        ({"model_path": "/m/Qwen2.5-7B", "chat_template": "... <tool_call> ..."}, "qwen"),
        ({"model_path": "/m/any", "chat_template": "{{ '[TOOL_CALLS]' }}"}, "mistral"),
        ({"model_path": "/m/Mistral-7B-Instruct-v0.3"}, "mistral"),
        ({"model_path": "/m/x", "chat_template": "<|python_tag|>"}, "llama3"),
        ({"model_path": "/m/unknown"}, "qwen"),
    ],
)
def test_tool_call_format(info, fmt):
    assert tool_call_format(info) == fmt


def test_template_renders_tools():
    assert template_renders_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_renders_tools("{{ messages }}")
    assert not template_renders_tools(None)


def _parser(fmt="smollm2"):
    parser = load_parser({"tool_call_format": fmt})
    assert parser is not None
    return parser


def test_prompt_messages_describe_tools_in_the_system_message():
    messages = [{"role": "user", "content": "hi"}]
    out = _parser().prompt_messages(messages, TOOLS)
    assert [m["role"] for m in out] == ["system", "user"]
    assert '"name": "get_weather"' in out[0]["content"] and "<tool_call>[" in out[0]["content"]
    with_system = _parser().prompt_messages([{"role": "system", "content": "Be brief."}, *messages], TOOLS)
    assert with_system[0]["content"].startswith("Be brief.\n\n") and "get_time" in with_system[0]["content"]
    assert _parser().prompt_messages(messages, None) == messages


@pytest.mark.parametrize("fmt", ["smollm2", "qwen", "llama3", "mistral"])
def test_prompt_messages_write_earlier_calls_as_text(fmt):
    call = {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "12:00"},
    ]
    out = _parser(fmt).prompt_messages(messages, None)
    assert "tool_calls" not in out[0]
    normal, calls = _parser(fmt).parse(out[0]["content"])
    assert normal == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"tz": "UTC"})
    ]
    assert out[1] == messages[1]


@pytest.fixture
def client():
    return make_client()[0]


def test_parse_function_call(client):
    text = 'Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "other", "arguments": {"a": 1}}\n</tool_call>'
    resp = client.post(
        "/parse_function_call", json={"text": text, "tool_call_parser": "qwen25", "tools": TOOLS}
    )
    assert resp.status_code == 200
    assert resp.json() == {
        "normal_text": "Sure.",
        "calls": [
            {"name": "get_time", "parameters": "{}", "tool_index": 1},
            {"name": "other", "parameters": '{"a": 1}', "tool_index": -1},
        ],
    }


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tool_call_parser": "qwen", "tools": []}, "text"),
        ({"text": ["x"], "tool_call_parser": "qwen", "tools": []}, "text"),
        ({"text": "x", "tools": []}, "tool_call_parser"),
        ({"text": "x", "tool_call_parser": "pythonic", "tools": []}, "tool_call_parser"),
        ({"text": "x", "tool_call_parser": "qwen"}, "tools"),
        ({"text": "x", "tool_call_parser": "qwen", "tools": [{"type": "function", "function": {}}]}, "tools"),
    ],
)
def test_parse_function_call_bad_input(client, body, field):
    resp = client.post("/parse_function_call", json=body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == field and field in error["message"]
