"""Bad requests: each is a 4xx whose message names the field, and the server stays healthy."""

from __future__ import annotations

import pytest

from tests.unit.test_server_fake_tm import make_client

G, C, CH = "/generate", "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

# (case id, path, body (dict, or raw bytes sent as JSON), status, text the message must contain)
CASES = [
    ("malformed-json", G, b'{"text": "a",', 400, "malformed JSON"),
    ("body-not-object", G, b"[1, 2]", 400, "object"),
    ("text-wrong-type", G, {"text": 5}, 400, "text"),
    ("text-empty", G, {"text": ""}, 400, "text"),
    ("text-batch-empty", G, {"text": []}, 400, "text"),
    ("text-batch-item-empty", G, {"text": ["a", ""]}, 400, "text.1"),
    ("both-text-and-ids", G, {"text": "a", "input_ids": [1]}, 400, "exactly one"),
    ("neither-text-nor-ids", G, {"sampling_params": {}}, 400, "exactly one"),
    ("input-ids-not-list", G, {"input_ids": 5}, 400, "input_ids"),
    ("input-ids-strings", G, {"input_ids": ["a"]}, 400, "input_ids"),
    ("input-ids-bool-as-int", G, {"input_ids": [True, 3]}, 400, "input_ids"),
    ("input-ids-negative", G, {"input_ids": [-1]}, 400, "input_ids"),
    ("input-ids-out-of-vocab", G, {"input_ids": [10**6]}, 400, "input_ids"),
    ("input-ids-empty", G, {"input_ids": []}, 400, "input_ids"),
    ("sampling-not-object", G, {"text": "a", "sampling_params": 3}, 400, "sampling_params"),
    ("unknown-sampling-key", G, {"text": "a", "sampling_params": {"temprature": 1}}, 400, "temprature"),
    (
        "max-new-tokens-negative",
        G,
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        400,
        "max_new_tokens",
    ),
    (
        "max-new-tokens-huge",
        G,
        {"text": "a", "sampling_params": {"max_new_tokens": 10**9}},
        400,
        "max_new_tokens",
    ),
    (
        "max-new-tokens-bool",
        G,
        {"text": "a", "sampling_params": {"max_new_tokens": True}},
        400,
        "max_new_tokens",
    ),
    (
        "max-new-tokens-string",
        G,
        {"text": "a", "sampling_params": {"max_new_tokens": "5"}},
        400,
        "max_new_tokens",
    ),
    ("temperature-negative", G, {"text": "a", "sampling_params": {"temperature": -0.1}}, 400, "temperature"),
    ("top-p-zero", G, {"text": "a", "sampling_params": {"top_p": 0}}, 400, "top_p"),
    ("top-k-bad", G, {"text": "a", "sampling_params": {"top_k": -5}}, 400, "top_k"),
    ("n-huge", G, {"text": "a", "sampling_params": {"n": 10000}}, 400, "sampling_params.n"),
    ("n-zero", G, {"text": "a", "sampling_params": {"n": 0}}, 400, "sampling_params.n"),
    ("n-float", G, {"text": "a", "sampling_params": {"n": 2.5}}, 400, "sampling_params.n"),
    (
        "two-grammars",
        G,
        {"text": "a", "sampling_params": {"regex": "a+", "ebnf": "root ::= 'a'"}},
        400,
        "ebnf",
    ),
    (
        "bad-json-schema",
        G,
        {"text": "a", "sampling_params": {"json_schema": "{not json"}},
        400,
        "json_schema",
    ),
    (
        "sampling-batch-mismatch",
        G,
        {"text": ["a", "b", "c"], "sampling_params": [{}, {}]},
        400,
        "sampling_params",
    ),
    ("logprob-start-len-bad", G, {"text": "a", "logprob_start_len": -5}, 400, "logprob_start_len"),
    (
        "logprob-start-len-past-prompt",
        G,
        {"text": "ab", "return_logprob": True, "logprob_start_len": 9},
        400,
        "logprob_start_len",
    ),
    ("logprob-start-len-string", G, {"text": "a", "logprob_start_len": "0"}, 400, "logprob_start_len"),
    ("top-logprobs-num-negative", G, {"text": "a", "top_logprobs_num": -1}, 400, "top_logprobs_num"),
    ("top-logprobs-num-huge", G, {"text": "a", "return_logprob": True, "top_logprobs_num": 10**5}, 400, "[0, 100]"),
    ("unknown-top-level-key", G, {"text": "a", "sampling_param": {}}, 400, "did you mean 'sampling_params'"),
    ("unsupported-sglang-field", G, {"text": "a", "lora_path": "x"}, 400, "lora_path: not supported"),
    ("deep-json", G, b'{"text": "a", "sampling_params": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "too deeply"),
    (
        "token-ids-logprob-out-of-vocab",
        G,
        {"text": "a", "token_ids_logprob": [10**6]},
        400,
        "token_ids_logprob",
    ),
    ("stream-not-bool", G, {"text": "a", "stream": "yes"}, 400, "stream"),
    ("return-logprob-int", G, {"text": "a", "return_logprob": 1}, 400, "return_logprob"),
    ("rid-count-mismatch", G, {"text": ["a", "b"], "rid": ["x"]}, 400, "rid"),
    ("rid-duplicates", G, {"text": ["a", "b"], "rid": ["x", "x"]}, 400, "rid"),
    ("priority-string", G, {"text": "a", "priority": "high"}, 400, "priority"),
    ("priority-huge", G, {"text": "a", "priority": 10**30}, 400, "priority: must be a 32-bit integer"),
    ("top-k-past-int64", G, {"text": "a", "sampling_params": {"top_k": 2**63}}, 400, "sampling_params.top_k"),
    ("tokenize-missing-prompt", "/v1/tokenize", {}, 400, "prompt"),
    ("detokenize-wrong-type", "/v1/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("abort-rid-wrong-type", "/abort_request", {"rid": 5}, 400, "rid"),
    ("flush-cache-negative-timeout", "/flush_cache", {"timeout": -1}, 400, "timeout"),
    # OpenAI routes
    ("oai-completions-missing-prompt", C, {"model": "m"}, 400, "prompt"),
    ("oai-completions-empty-prompt", C, {"prompt": []}, 400, "prompt"),
    ("oai-completions-max-tokens-negative", C, {"prompt": "a", "max_tokens": -3}, 400, "max_tokens"),
    ("oai-completions-max-tokens-over-context", C, {"prompt": "a", "max_tokens": 10**6}, 400, "max_tokens: "),
    ("oai-unknown-model", C, {"model": "gpt-4o", "prompt": "a"}, 404, "model: the model 'gpt-4o' does not exist"),
    ("oai-completions-temperature-string", C, {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("oai-completions-n-huge", C, {"prompt": "a", "n": 10000}, 400, "n"),
    ("oai-completions-logprobs-huge", C, {"prompt": "a", "logprobs": 500}, 400, "logprobs"),
    ("oai-completions-stop-wrong-type", C, {"prompt": "a", "stop": 5}, 400, "stop"),
    ("oai-completions-seed-string", C, {"prompt": "a", "seed": "x"}, 400, "seed"),
    ("oai-chat-missing-messages", CH, {"model": "m"}, 400, "messages"),
    ("oai-chat-empty-messages", CH, {"messages": []}, 400, "messages"),
    ("oai-chat-bad-role", CH, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    (
        "oai-chat-image-part",
        CH,
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}
            ]
        },
        400,
        "messages.0.content.0",
    ),
    ("oai-chat-top-p-zero", CH, {"messages": MSG, "top_p": 0}, 400, "top_p"),
    ("oai-chat-top-logprobs-without-logprobs", CH, {"messages": MSG, "top_logprobs": 3}, 400, "top_logprobs"),
    (
        "oai-chat-response-format-bad-type",
        CH,
        {"messages": MSG, "response_format": {"type": "xml"}},
        400,
        "response_format",
    ),
    (
        "oai-chat-json-schema-missing-schema",
        CH,
        {"messages": MSG, "response_format": {"type": "json_schema"}},
        400,
        "response_format",
    ),
    (
        "oai-chat-max-completion-tokens-huge",
        CH,
        {"messages": MSG, "max_completion_tokens": 10**7},
        400,
        "max_completion_tokens",
    ),
    (
        "oai-chat-template-failure",
        CH,
        {"messages": [{"role": "user", "content": "BREAK_TEMPLATE"}]},
        400,
        "chat template",
    ),
    (
        "oai-chat-tool-choice-unknown",
        CH,
        {
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice",
    ),
    ("oai-chat-logit-bias-bad-key", CH, {"messages": MSG, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
]


@pytest.fixture(scope="module")
def client():
    return make_client()[0]


@pytest.mark.parametrize(
    ("path", "body", "status", "mentions"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_4xx_naming_the_field(client, path, body, status, mentions):
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert mentions in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert err["code"] == status or (status, err["code"]) == (404, "model_not_found")
    assert client.get("/health").status_code == 200


def test_table_is_large_enough():
    assert len(CASES) >= 30


def test_server_still_generates_after_all_bad_inputs(client):
    r = client.post("/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["text"] == "ok"
