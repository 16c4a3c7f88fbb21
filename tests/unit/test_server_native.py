"""Native routes against a fake TokenizerManager: /generate (JSON, batch, n, SSE), admin routes,
auth, body limit, disconnects."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from phloem.runtime.server.app import create_app
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_server_fake_tm import FakeTokenizerManager, make_client


def sse_events(text: str) -> list:
    """Parse an SSE body; asserts the framing (``data: ...`` blocks, ``[DONE]`` last)."""
    blocks = text.split("\n\n")
    assert blocks[-1] == "", "body must end with a blank line"
    payloads = []
    for block in blocks[:-1]:
        assert block.startswith("data: "), block
        payloads.append(block[len("data: ") :])
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


# ---- /generate -----------------------------------------------------------------------------------
def test_generate_text_echoes_and_reports_meta():
    client, tm = make_client()
    r = client.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == "hel"
    assert body["output_ids"] == [104, 101, 108]
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 3
    assert tm.requests[0].sampling_params.max_new_tokens == 3


def test_generate_input_ids_and_sglang_fields_at_their_defaults():
    client, tm = make_client()
    r = client.post(
        "/generate",
        json={
            "input_ids": [104, 105],
            "image_data": None,
            "lora_path": None,
            "modalities": [],
            "log_metrics": False,
            "custom_labels": {"team": "a"},
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "hihihihi"
    assert tm.requests[0].input_ids == [104, 105] and tm.requests[0].text is None


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"text": "a", "sampling_param": {"max_new_tokens": 1}}, "sampling_param", "did you mean 'sampling_params'"),
        ({"text": "a", "strem": True}, "strem", "did you mean 'stream'"),
        ({"text": "a", "zzz": 1}, "zzz", "unknown field"),
        ({"text": "a", "lora_path": "x"}, "lora_path", "not supported"),
        ({"text": "a", "image_data": ["http://x/cat.png"]}, "image_data", "not supported"),
        ({"text": "a", "return_hidden_states": True}, "return_hidden_states", "not supported"),
    ],
)
def test_generate_refuses_unknown_and_unsupported_fields_naming_them(body, param, needle):
    client, tm = make_client()
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: ") and needle in err["message"]
    assert not tm.requests  # nothing ran on defaults


def test_other_native_bodies_refuse_unknown_fields():
    client, _ = make_client()
    for path, body, param in [
        ("/v1/tokenize", {"prompt": "a", "add_special_token": False}, "add_special_token"),
        ("/v1/detokenize", {"tokens": [1], "skip_special": True}, "skip_special"),
        ("/abort_request", {"rid": "x", "abort": True}, "abort"),
        ("/flush_cache", {"timeout": 1, "x": 1}, "x"),
    ]:
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
    assert client.post("/v1/tokenize", json={"prompt": "a", "model": "m"}).status_code == 200


def test_deep_json_is_reported_as_too_deep_not_malformed():
    client, _ = make_client()
    deep = '{"text": "a", "sampling_params": {"json_schema": ' + "[" * 1000 + "]" * 1000 + "}}"
    r = client.post("/generate", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "nested too deeply" in message and "malformed" not in message


def test_generate_batch_returns_list_in_order():
    client, _ = make_client()
    r = client.post(
        "/generate",
        json={"text": ["ab", "cd"], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 1}]},
    )
    assert r.status_code == 200, r.text
    assert [o["text"] for o in r.json()] == ["ab", "c"]


def test_generate_batch_input_ids_with_rids():
    client, tm = make_client()
    r = client.post(
        "/generate",
        json={"input_ids": [[104], [105]], "rid": ["a", "b"], "sampling_params": {"max_new_tokens": 1}},
    )
    assert r.status_code == 200, r.text
    assert [o["meta_info"]["id"] for o in r.json()] == ["a", "b"]
    assert [q.rid for q in tm.requests] == ["a", "b"]


def test_generate_n_expands_into_a_list_with_distinct_seeds():
    client, tm = make_client()
    r = client.post(
        "/generate",
        json={"text": "xy", "rid": "r", "sampling_params": {"n": 3, "max_new_tokens": 2, "sampling_seed": 7}},
    )
    assert r.status_code == 200, r.text
    assert len(r.json()) == 3
    assert sorted(q.rid for q in tm.requests) == ["r-0", "r-1", "r-2"]
    assert sorted(q.sampling_params.sampling_seed for q in tm.requests) == [7, 8, 9]
    assert all(q.sampling_params.n == 1 for q in tm.requests)


def test_generate_batch_with_n_is_prompt_major():
    client, _ = make_client()
    r = client.post("/generate", json={"text": ["a", "b"], "sampling_params": {"n": 2, "max_new_tokens": 1}})
    assert [o["text"] for o in r.json()] == ["a", "a", "b", "b"]


def test_generate_stream_sse_format():
    client, _ = make_client()
    r = client.post(
        "/generate", json={"text": "abc", "stream": True, "sampling_params": {"max_new_tokens": 3}}
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert [e["text"] for e in events] == ["a", "ab", "abc"]  # cumulative
    assert [e["output_ids"] for e in events][-1] == [97, 98, 99]
    assert "index" not in events[0]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_batch_stream_carries_index():
    client, _ = make_client()
    r = client.post(
        "/generate", json={"text": ["ab", "cd"], "stream": True, "sampling_params": {"max_new_tokens": 2}}
    )
    events = sse_events(r.text)
    final = {e["index"]: e["text"] for e in events if e["meta_info"]["finish_reason"]}
    assert final == {0: "ab", 1: "cd"}


def test_generate_logprobs_with_text_and_clamped_inf():
    client, tm = make_client()
    r = client.post(
        "/generate",
        json={
            "text": "abc",
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 2},
        },
    )
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 97, "a"], [-0.5, 98, "b"]]
    assert meta["output_top_logprobs"][0] == [[-0.5, 97, "a"], [-1.5, 98, "b"]]
    assert meta["input_token_logprobs"][0] == [None, 97, "a"]
    assert meta["input_token_logprobs"][1][0] == -9999.0  # -inf is not JSON
    assert tm.requests[0].top_logprobs_num == 2


def test_generate_logprobs_without_text():
    client, _ = make_client()
    r = client.post(
        "/generate", json={"text": "ab", "return_logprob": True, "sampling_params": {"max_new_tokens": 1}}
    )
    assert r.json()["meta_info"]["output_token_logprobs"] == [[-0.5, 97, None]]


@pytest.mark.parametrize(("prompt", "status"), [("ABORTME", 503), ("GRAMMARFAIL", 400)])
def test_aborted_request_is_an_error_not_200(prompt, status):
    client, _ = make_client()
    r = client.post("/generate", json={"text": prompt})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["code"] == status
    assert err["finish_reason"]["type"] == "abort" and err["finish_reason"]["status_code"] == status
    assert client.get("/health").status_code == 200


def test_abort_mid_stream_is_an_error_event():
    client, _ = make_client()
    r = client.post(
        "/generate", json={"text": "ABORTME", "stream": True, "sampling_params": {"max_new_tokens": 4}}
    )
    events = sse_events(r.text)
    assert "error" in events[-1]
    assert events[-1]["error"]["message"] == "engine failure: scheduler died"


def test_request_error_at_tokenization_is_400_even_when_streaming():
    client, _ = make_client()
    for stream in (False, True):
        r = client.post("/generate", json={"text": "BADPROMPT", "stream": stream})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "text"
        assert "context length" in r.json()["error"]["message"]
        assert r.json()["error"]["message"].startswith("text: the prompt has ")


def test_an_invalid_request_message_names_its_field_unless_it_already_does():
    from phloem.runtime.errors import InvalidRequest
    from phloem.runtime.server.http_errors import from_invalid_request

    def message(field: str, text: str) -> str:
        return from_invalid_request(InvalidRequest(field, text)).message

    # "text" inside "context" is not the field named
    assert message("text", "the model's context length is 8") == "text: the model's context length is 8"
    assert message("input_ids", "input_ids[2] is out of range") == "input_ids[2] is out of range"
    assert message("top_k", "must be >= 1, unlike top_k_max") == "top_k: must be >= 1, unlike top_k_max"


def test_grammar_abort_names_the_grammar_field():
    """The engine's abort for a grammar that does not compile names its field, in ``param`` and at
    the start of the message; it comes before the first token, so a stream is refused with the
    same 400 rather than opened (and the batch's other request goes with it)."""
    client, tm = make_client()
    for body in (
        {"text": "GRAMMARFAIL"},
        {"text": "GRAMMARFAIL", "stream": True},
        {"text": ["fine", "GRAMMARFAIL"], "stream": True},
    ):
        r = client.post("/generate", json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == "sampling_params.json_schema"
        assert err["message"] == "sampling_params.json_schema: invalid grammar: does not compile"
    assert not tm.running


def test_request_error_from_engine_names_sampling_field():
    client, _ = make_client()
    r = client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 5000}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "sampling_params.max_new_tokens"


def test_generate_refused_with_503_while_shutting_down():
    client, tm = make_client()
    tm.start_shutdown()
    r = client.post("/generate", json={"text": "a"})
    assert r.status_code == 503
    assert client.get("/health").status_code == 503


def test_shutdown_during_request_gives_503():
    tm = FakeTokenizerManager()
    app = create_app(tm)

    async def scenario():
        import httpx

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            task = asyncio.create_task(c.post("/generate", json={"text": "SLOW" * 3}))
            await asyncio.sleep(0.2)
            tm.start_shutdown()
            return await task

    r = asyncio.run(scenario())
    assert r.status_code == 503
    assert "shutting down" in r.json()["error"]["message"]


def test_request_the_engine_forgets_during_shutdown_gets_503():
    tm = FakeTokenizerManager()
    tm.abort_on_shutdown = False
    app = create_app(tm)

    async def scenario():
        import httpx

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            body = {"text": "SLOW", "sampling_params": {"max_new_tokens": 200}}
            task = asyncio.create_task(c.post("/generate", json=body))
            await asyncio.sleep(0.2)
            tm.start_shutdown()
            start = time.monotonic()
            r = await task
            return r, time.monotonic() - start

    r, waited = asyncio.run(scenario())
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    assert waited < 4  # well before the 10 s the generation would take


# ---- disconnects ---------------------------------------------------------------------------------
async def _call_then_disconnect(app, body: dict, after_s: float) -> list:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/generate",
        "raw_path": b"/generate",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    raw = json.dumps(body).encode()
    start, sent_body, sent = time.monotonic(), False, []

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        left = start + after_s - time.monotonic()
        if left > 0:  # like uvicorn: wait for the socket to close, answer at once once it has
            await asyncio.sleep(left)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_generation(stream):
    tm = FakeTokenizerManager()
    app = create_app(tm)
    body = {"text": "SLOW" * 10, "stream": stream, "rid": "gone", "sampling_params": {"max_new_tokens": 40}}
    start = time.monotonic()
    asyncio.run(_call_then_disconnect(app, body, after_s=0.3))
    assert time.monotonic() - start < 1.8  # 40 tokens x 50 ms would take 2 s
    assert tm.cancelled == ["gone"] and tm.finished == []


# ---- admin ---------------------------------------------------------------------------------------
def test_health_and_health_generate():
    client, tm = make_client()
    assert client.get("/health").status_code == 200
    r = client.get("/health_generate")
    assert r.status_code == 200, r.text
    assert tm.requests[-1].sampling_params.max_new_tokens == 1
    tm.status = "broken"
    assert client.get("/health").status_code == 503
    assert client.get("/health_generate").status_code == 503


def test_health_is_503_while_the_scheduler_is_stalled_and_200_when_beats_resume():
    client, tm = make_client()
    tm.now += 12.3  # no heartbeat for 12.3 s
    r = client.get("/health")
    assert r.status_code == 503
    assert r.json() == {"status": "stalled", "message": "no scheduler heartbeat for 12.3 s"}
    r = client.get("/health_generate")
    assert r.status_code == 503 and r.json()["status"] == "stalled" and tm.requests == []
    tm.liveness.beat(loop_age=0.0)
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "serving"}


def test_request_routes_refuse_with_503_while_stalled():
    client, tm = make_client()
    tm.now += 6.0
    calls = [
        ("post", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
        ("post", "/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": 2}),
        ("post", "/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}),
        ("post", "/flush_cache", None),
        ("post", "/update_weights_from_disk", {"model_path": "/m"}),
        ("post", "/update_weights_from_tensor", {"tensor_file": "/t"}),
        ("get", "/health_generate", None),
    ]
    for method, path, body in calls:
        r = client.request(method.upper(), path, json=body)
        assert r.status_code == 503, (path, r.text)
        if path != "/health_generate":
            assert "stalled" in r.json()["error"]["message"], path
    assert tm.requests == []  # nothing reached the engine
    info = client.get("/get_server_info").json()
    assert info["status"] == "stalled"


def test_health_of_a_broken_engine_says_why():
    client, tm = make_client()
    tm.status = "broken"
    tm.broken_reason = "child process died: phloem-scheduler (exit code 3)"
    r = client.get("/health")
    assert r.status_code == 503
    assert r.json() == {"status": "broken", "message": "child process died: phloem-scheduler (exit code 3)"}


def test_model_info_routes():
    client, _ = make_client()
    for path in ("/model_info", "/get_model_info"):
        info = client.get(path).json()
        assert info["model_path"] == "fake-model"
        assert info["tokenizer_path"] == "fake-model"
        assert info["is_generation"] is True
        assert info["chat_template"] == "{{ messages }}"


def test_server_info_routes():
    client, _ = make_client()
    for path in ("/server_info", "/get_server_info"):
        info = client.get(path).json()
        assert info["status"] == "serving" and info["port"] == 30000


def test_flush_cache():
    client, tm = make_client()
    assert client.post("/flush_cache").status_code == 200
    assert client.get("/flush_cache?timeout=1.5").status_code == 200
    assert client.post("/flush_cache", json={"timeout": 2}).status_code == 200
    assert client.get("/flush_cache?timeout=abc").status_code == 400
    tm.running["busy"] = False
    r = client.post("/flush_cache")
    assert r.status_code == 400 and "running" in r.json()["error"]["message"]


def test_abort_request_route():
    client, tm = make_client()
    assert client.post("/abort_request", json={"rid": "x"}).status_code == 200
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
    assert tm.aborts == [("x", False), (None, True)]
    assert client.post("/abort_request", json={}).status_code == 400


def test_abort_request_stops_a_running_generation():
    tm = FakeTokenizerManager()
    app = create_app(tm)

    async def scenario():
        import httpx

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            task = asyncio.create_task(
                c.post(
                    "/generate", json={"text": "SLOW", "rid": "k", "sampling_params": {"max_new_tokens": 40}}
                )
            )
            await asyncio.sleep(0.2)
            assert (await c.post("/abort_request", json={"rid": "k"})).status_code == 200
            return await task

    r = asyncio.run(scenario())  # SGLang's contract: an answer, its finish reason says abort
    assert r.status_code == 200
    reason = r.json()["meta_info"]["finish_reason"]
    assert reason == {"type": "abort", "message": "aborted by request"}
    assert 0 < r.json()["meta_info"]["completion_tokens"] < 40


def _abort_midway(path: str, body: dict, rid_of):
    """POST ``body`` to ``path``, abort its request (rid from ``rid_of(tm)``) after 0.2 s."""
    tm = FakeTokenizerManager()
    app = create_app(tm)

    async def scenario():
        import httpx

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            task = asyncio.create_task(c.post(path, json=body))
            await asyncio.sleep(0.2)
            assert (await c.post("/abort_request", json={"rid": rid_of(tm)})).status_code == 200
            return await task

    return asyncio.run(scenario())


def test_a_stream_aborted_by_the_caller_ends_with_the_reason_not_an_error():
    body = {"text": "SLOW", "rid": "s", "stream": True, "sampling_params": {"max_new_tokens": 40}}
    r = _abort_midway("/generate", body, lambda tm: "s")
    assert r.status_code == 200
    events = sse_events(r.text)
    assert not any("error" in e for e in events)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted by request"}
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_a_chat_aborted_by_the_caller_answers_with_finish_reason_abort():
    body = {"messages": [{"role": "user", "content": "SLOW"}], "max_tokens": 40}
    r = _abort_midway("/v1/chat/completions", body, lambda tm: next(iter(tm.running)))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "abort"


def test_tokenize_and_detokenize():
    client, _ = make_client()
    r = client.post("/v1/tokenize", json={"prompt": "hi", "add_special_tokens": False})
    assert r.json()["tokens"] == [104, 105] and r.json()["count"] == 2
    r = client.post("/v1/tokenize", json={"prompt": ["a", "bc"]})
    assert r.json()["tokens"] == [[1, 97], [1, 98, 99]] and r.json()["count"] == [2, 3]
    assert client.post("/v1/detokenize", json={"tokens": [104, 105]}).json()["text"] == "hi"
    assert client.post("/v1/detokenize", json={"tokens": [[104], [105]]}).json()["text"] == ["h", "i"]
    r = client.post("/v1/detokenize", json={"tokens": [5000]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_update_weights_take_sglangs_weight_version_and_flush_cache():
    client, tm = make_client()
    body = {"model_path": "/models/new", "weight_version": "step-7", "flush_cache": True}
    assert client.post("/update_weights_from_disk", json=body).status_code == 200
    assert client.get("/get_model_info").json()["weight_version"] == "step-7"
    r = client.post("/update_weights_from_disk", json={"model_path": "/models/new", "flush_cache": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "flush_cache"
    r = client.post("/update_weights_from_tensor", json={"tensor_file": "/w", "load_format": "direct"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "load_format"
    r = client.post("/update_weights_from_disk", json={"model_path": "/bad", "weight_version": "step-8"})
    assert r.status_code == 400 and client.get("/get_model_info").json()["weight_version"] == "step-7"


def test_update_weights_routes():
    client, tm = make_client()
    r = client.post("/update_weights_from_disk", json={"model_path": "/models/new", "abort_all_requests": True})
    assert r.status_code == 200 and r.json() == {"success": True, "message": "loaded"}
    assert tm.weight_updates[-1] == {"model_path": "/models/new", "abort_all_requests": True}
    r = client.post("/update_weights_from_disk", json={"model_path": "/bad"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert r.json()["error"]["param"] == "model_path" and "model_path" in r.json()["message"]
    r = client.post("/update_weights_from_disk", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
    r = client.post("/update_weights_from_tensor", json={"tensor_file": "/tmp/w.safetensors"})
    assert r.status_code == 200 and r.json()["message"] == "loaded /tmp/w.safetensors"
    r = client.post("/update_weights_from_tensor", json={"safetensors_b64": base64.b64encode(b"abc").decode()})
    assert r.status_code == 200 and tm.weight_updates[-1]["tensor_data"] == b"abc"
    assert tm.weight_updates[-1]["field"] == "safetensors_b64"


def test_update_weights_refusals_name_the_field():
    client, tm = make_client()
    for body, param in [
        ({}, "tensor_file"),
        ({"tensor_file": "/a", "safetensors_b64": "YQ=="}, "tensor_file"),
        ({"safetensors_b64": "not base64!"}, "safetensors_b64"),
        ({"serialized_named_tensors": ["gASV"]}, "serialized_named_tensors"),  # pickled: never read
    ]:
        r = client.post("/update_weights_from_tensor", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.json())
        assert r.json()["success"] is False
    assert tm.weight_updates == []  # nothing reached the engine


def test_update_weights_engine_fault_is_a_generic_500():
    client, _ = make_client()
    r = client.post("/update_weights_from_disk", json={"model_path": "/crash"})
    assert r.status_code == 500
    assert r.json()["success"] is False and r.json()["message"] == "internal error"
    assert r.json()["error"]["message"] == "internal error"


def test_unexpected_exception_does_not_reach_the_client():
    client, tm = make_client()

    async def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret /home/path detail")

    tm.update_weights_from_disk = boom
    r = TestClient(client.app, raise_server_exceptions=False).post(
        "/update_weights_from_disk", json={"model_path": "/x"}
    )
    assert r.status_code == 500 and r.json()["error"]["message"].startswith("internal server error (incident ")
    assert "secret" not in r.text and "RuntimeError" not in r.text


def test_metrics_parse_and_count_requests():
    client, tm = make_client()
    client.post("/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 1}})
    tm.metrics.update_scheduler_stats({"num_running_reqs": 3, "token_usage": 0.5, "num_retracted_reqs": 2})
    r = client.get("/metrics")
    assert r.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert families["phloem:num_running_reqs"].samples[0].value == 3
    assert families["phloem:num_requests"].samples[0].value == 1
    assert "phloem:time_to_first_token_seconds" in families


# ---- auth and limits -----------------------------------------------------------------------------
def test_api_key_guards_all_but_health_and_metrics():
    client, _ = make_client(api_key="sekret")
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    for method, path in [
        ("post", "/generate"),
        ("get", "/model_info"),
        ("get", "/v1/models"),
        ("post", "/v1/chat/completions"),
        ("get", "/health_generate"),
    ]:
        r = getattr(client, method)(path)
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "authentication_error"
    r = client.post("/generate", json={"text": "a"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = client.post(
        "/generate",
        json={"text": "a", "sampling_params": {"max_new_tokens": 1}},
        headers={"Authorization": "Bearer sekret"},
    )
    assert r.status_code == 200


def test_no_api_key_means_open():
    client, _ = make_client()
    assert client.get("/v1/models").status_code == 200


def test_body_limit_413_then_still_healthy():
    client, _ = make_client(max_request_body_bytes=1000)
    r = client.post("/generate", json={"text": "a" * 2000})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413

    def chunks():
        for _ in range(5):
            yield b" " * 400

    r = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413  # no content-length: counted while reading
    r = client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200


def test_an_unexpected_error_reaches_the_client_as_an_incident_id_only(caplog):
    client, tm = make_client()

    async def broken(req):
        raise RuntimeError("cannot open /srv/private/weights.bin for user alice")
        yield  # pragma: no cover

    tm.generate = broken
    r = client.post("/generate", json={"text": "a"})
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "alice" not in message and "RuntimeError" not in message
    incident = message.split("incident ")[1].split(";")[0]
    logged = [rec for rec in caplog.records if incident in rec.getMessage()]
    assert logged and "alice" in logged[0].getMessage()  # the operator sees it all


def test_health_generate_answers_at_once_while_generation_is_held():
    client, tm = make_client()
    tm.held = lambda: "generation is paused"
    r = client.get("/health_generate")
    assert r.status_code == 503 and r.json() == {"status": "held", "message": "generation is paused"}
    tm.held = lambda: ""
    assert client.get("/health_generate").status_code == 200
