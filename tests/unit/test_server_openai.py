"""OpenAI routes, driven by the official ``openai`` client over the ASGI app."""

from __future__ import annotations

import json

import pytest

# the test extra installs it (CI); a machine without it (the GPU host) collects this module empty
openai = pytest.importorskip("openai", reason="the openai client is a test extra")
from phloem.runtime.server import openai_api  # noqa: E402

from tests.unit.test_server_fake_tm import make_client  # noqa: E402

MSG = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.fixture
def setup():
    client, tm = make_client()
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)
    return oai, tm


def test_models(setup):
    oai, _ = setup
    models = oai.models.list()
    assert [m.id for m in models.data] == ["fake"]


def test_an_unknown_model_is_404_model_not_found_and_aliases_pass(setup):
    oai, _ = setup
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=1)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    assert "'fake'" in info.value.body["message"]  # says which model it serves
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="fake-2", prompt="a", max_tokens=1)
    for name in ("fake", "default", "fake-model"):  # served name, SGLang's default, the path
        assert oai.completions.create(model=name, prompt="a", max_tokens=1).choices


def test_unknown_fields_are_ignored_by_default_and_refused_under_strict_api():
    from phloem.runtime.server.openai_protocol import ChatCompletionRequest, unknown_fields

    raw = {"messages": [{"role": "user", "content": "a", "nam": "x"}], "max_token": 3, "stream": False}
    body = ChatCompletionRequest.model_validate(raw)
    assert unknown_fields(body, raw) == ["messages[0].nam", "max_token"]
    raw = {"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_schema",
           "json_schema": {"name": "n", "schema": {}, "strictt": True}}}  # fmt: skip
    assert unknown_fields(ChatCompletionRequest.model_validate(raw), raw) == ["response_format.json_schema.strictt"]

    client, _ = make_client()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_token": 3, "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    client, _ = make_client(strict_api=True)
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_token"
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "echoo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echoo"
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


def test_model_aliases_take_the_path_its_file_name_and_stem():
    from phloem.runtime.server.native import model_aliases

    _, tm = make_client()
    tm.model_info = {**tm.model_info, "model_path": "/models/smol/SmolLM2-135M-Q8_0.gguf"}
    names = model_aliases(tm)
    assert {"fake", "default", "fake-model", "SmolLM2-135M-Q8_0.gguf", "SmolLM2-135M-Q8_0"} <= names
    assert "/models/smol/SmolLM2-135M-Q8_0.gguf" in names and "smol" not in names


def test_chat_completion(setup):
    oai, tm = setup
    r = oai.chat.completions.create(
        model="fake", messages=MSG, max_tokens=4, temperature=0, seed=11, stop=["zz"], extra_body={"top_k": 5}
    )
    assert r.id.startswith("chatcmpl-") and r.model == "fake" and r.object == "chat.completion"
    prompt = "system:be brief\nuser:hi\nassistant:"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == prompt[:4]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 4
    assert r.usage.prompt_tokens_details.cached_tokens == 3
    req = tm.requests[0]
    assert tm.tokenizer.decode(req.input_ids) == prompt
    sp = req.sampling_params
    assert (sp.max_new_tokens, sp.temperature, sp.sampling_seed, sp.stop, sp.top_k) == (4, 0.0, 11, ["zz"], 5)


def test_chat_defaults_max_tokens_to_the_rest_of_the_context(setup):
    oai, tm = setup
    r = oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hey"}])
    assert r.choices[0].finish_reason == "stop"
    req = tm.requests[0]
    assert req.sampling_params.max_new_tokens == tm.context_len - len(req.input_ids)


def test_chat_content_parts_and_max_completion_tokens(setup):
    oai, tm = setup
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    oai.chat.completions.create(model="fake", messages=msgs, max_completion_tokens=2)
    assert tm.tokenizer.decode(tm.requests[0].input_ids) == "user:ab\nassistant:"
    assert tm.requests[0].sampling_params.max_new_tokens == 2


def test_chat_stream_with_usage(setup):
    oai, _ = setup
    stream = oai.chat.completions.create(
        model="fake", messages=MSG, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "syste"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_chat_n2_and_logprobs(setup):
    oai, tm = setup
    r = oai.chat.completions.create(
        model="fake", messages=MSG, max_tokens=2, n=2, logprobs=True, top_logprobs=2, seed=3
    )
    assert [c.index for c in r.choices] == [0, 1]
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == ["s", "y"]
    assert content[0].logprob == -0.5 and content[0].bytes == [115]
    assert [t.token for t in content[0].top_logprobs] == ["s", "t"]
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens == tm.requests[0].input_ids.__len__()
    assert sorted(q.sampling_params.sampling_seed for q in tm.requests) == [3, 4]


def test_chat_stream_n2_logprobs(setup):
    oai, _ = setup
    stream = oai.chat.completions.create(
        model="fake", messages=MSG, max_tokens=3, n=2, stream=True, logprobs=True
    )
    texts = {0: "", 1: ""}
    tokens = {0: [], 1: []}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.logprobs and c.logprobs.content:
                tokens[c.index] += [e.token for e in c.logprobs.content]
    assert texts == {0: "sys", 1: "sys"}
    assert tokens == {0: ["s", "y", "s"], 1: ["s", "y", "s"]}


def test_chat_response_format(setup):
    oai, tm = setup
    oai.chat.completions.create(
        model="fake", messages=MSG, max_tokens=1, response_format={"type": "json_object"}
    )
    assert json.loads(tm.requests[-1].sampling_params.json_schema) == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    oai.chat.completions.create(
        model="fake",
        messages=MSG,
        max_tokens=1,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": True},
        },
    )
    assert json.loads(tm.requests[-1].sampling_params.json_schema) == schema
    oai.chat.completions.create(model="fake", messages=MSG, max_tokens=1, response_format={"type": "text"})
    assert tm.requests[-1].sampling_params.json_schema is None


def test_completions_n2_usage_counts_prompt_once(setup):
    oai, _ = setup
    r = oai.completions.create(model="fake", prompt="hello", max_tokens=3, n=2)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert [(c.index, c.text) for c in r.choices] == [(0, "hel"), (1, "hel")]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 6 and r.usage.total_tokens == 11


def test_completions_batch_of_token_prompts(setup):
    oai, tm = setup
    r = oai.completions.create(model="fake", prompt=[[104, 105], [111]], max_tokens=2)
    assert [c.text for c in r.choices] == ["hi", "oo"]
    assert tm.requests[0].input_ids == [104, 105]


def test_completions_logprobs_and_echo(setup):
    oai, tm = setup
    r = oai.completions.create(model="fake", prompt="abc", max_tokens=2, logprobs=1, echo=True)
    choice = r.choices[0]
    assert choice.text == "abcab"
    assert choice.logprobs.tokens == ["a", "b", "c", "a", "b"]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.token_logprobs[-1] == -0.5
    assert choice.logprobs.text_offset == [0, 1, 2, 3, 4]
    assert choice.logprobs.top_logprobs[-1] == {"b": -0.5}
    assert tm.requests[0].logprob_start_len == 0


def test_completions_stream(setup):
    oai, _ = setup
    stream = oai.completions.create(
        model="fake", prompt="abcd", max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "abcd"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == 8


def test_completions_stream_echo_logprobs(setup):
    oai, _ = setup
    chunks = list(
        oai.completions.create(model="fake", prompt="ab", max_tokens=2, stream=True, echo=True, logprobs=0)
    )
    assert "".join(c.choices[0].text for c in chunks) == "abab"
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert tokens == ["a", "b", "a", "b"]


def test_openai_errors_have_openai_shape(setup):
    oai, _ = setup
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="fake", prompt="a", max_tokens=-1)
    body = info.value.body
    assert body["param"] == "max_tokens" and body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="fake", messages=MSG, temperature=-1)


def test_a_prompt_over_the_context_is_refused_naming_the_clients_field(setup):
    oai, tm = setup
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="fake", prompt="BADPROMPT", max_tokens=1)
    assert info.value.body["param"] == "prompt"
    assert info.value.body["message"].startswith("prompt: the prompt has ")
    huge = [{"role": "user", "content": "x" * tm.context_len}]
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="fake", messages=huge, max_tokens=1)
    assert info.value.body["param"] == "messages"
    assert info.value.body["message"].startswith("messages: the prompt has ")
    assert "context length is 4096" in info.value.body["message"] and not tm.requests


def test_aborted_chat_is_an_error(setup):
    oai, _ = setup
    with pytest.raises(openai.InternalServerError):
        oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "ABORTME"}])
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "GRAMMARFAIL"}])
    # the engine names sampling_params.json_schema; a chat client sent response_format
    assert info.value.body["param"] == "response_format"
    assert info.value.body["message"].startswith("response_format: ")


def test_grammar_abort_refuses_a_chat_stream_with_400():
    client, _ = make_client()
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "GRAMMARFAIL"}], "stream": True, "max_tokens": 3},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"


def test_openai_param_maps_engine_fields_to_the_clients():
    from phloem.runtime.server.openai_api import CHAT_NAMES, COMPLETION_NAMES
    from phloem.runtime.server.request_runner import openai_param

    assert openai_param("sampling_params.max_new_tokens", CHAT_NAMES) == "max_tokens"
    assert openai_param("sampling_params.stop[1]", COMPLETION_NAMES) == "stop[1]"
    assert openai_param("sampling_params.json_schema", CHAT_NAMES) == "response_format"
    assert openai_param("sampling_params.structural_tag", CHAT_NAMES) == "tools"
    assert openai_param("sampling_params.regex", COMPLETION_NAMES) == "regex"


def test_aborted_stream_ends_with_error_event():
    client, _ = make_client()
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "ABORTME"}], "stream": True, "max_tokens": 3},
    )
    lines = [ln for ln in r.text.split("\n\n") if ln]
    assert lines[-1] == "data: [DONE]"
    assert "error" in json.loads(lines[-2][len("data: ") :])


# ---- tools ---------------------------------------------------------------------------------------
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "weather", "parameters": {"type": "object"}},
    }
]


def test_tools_unsupported_without_formats_module(setup, monkeypatch):
    oai, _ = setup
    monkeypatch.setattr(openai_api, "load_parser", lambda model_info: None)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="fake", messages=MSG, tools=TOOLS)
    assert "tools are not supported" in info.value.body["message"]


def test_tool_calls_parsed(setup):
    oai, tm = setup
    msgs = [{"role": "user", "content": "TOOLCALL"}]
    r = oai.chat.completions.create(model="fake", messages=msgs, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."  # the space before the call separates it
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    assert tm.tokenizer.decode(tm.requests[0].input_ids).startswith("tools:get_weather\n")
    assert tm.requests[0].sampling_params.structural_tag is None  # tool_choice auto: not forced


def test_tool_calls_streamed(setup):
    oai, _ = setup
    msgs = [{"role": "user", "content": "TOOLCALL"}]
    chunks = list(
        oai.chat.completions.create(model="fake", messages=msgs, tools=TOOLS, max_tokens=200, stream=True)
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Let me check."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_forces_a_call_with_a_structural_tag(setup, choice):
    oai, tm = setup
    oai.chat.completions.create(model="fake", messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=1)
    tag = json.loads(tm.requests[0].sampling_params.structural_tag)
    assert tag["type"] == "structural_tag" and "get_weather" in json.dumps(tag)


def test_tool_history_and_tool_choice_none(setup):
    oai, tm = setup
    msgs = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = oai.chat.completions.create(
        model="fake", messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert r.choices[0].finish_reason == "length"
    assert "tool:sunny" in tm.tokenizer.decode(tm.requests[0].input_ids)


def test_logprob_mode_passes_through_and_bad_values_are_400(setup):
    oai, tm = setup
    oai.completions.create(model="fake", prompt="a", max_tokens=2, logprobs=1, extra_body={"logprob_mode": "processed"})
    assert tm.requests[-1].sampling_params.logprob_mode == "processed"
    oai.chat.completions.create(model="fake", messages=MSG, max_tokens=2, logprobs=True)
    assert tm.requests[-1].sampling_params.logprob_mode == "raw"
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="fake", prompt="a", max_tokens=2, extra_body={"logprob_mode": "scaled"})
    assert "logprob_mode" in info.value.body["message"]
