"""Property-based fuzzing of /generate, /v1/completions and /v1/chat/completions on the real server.

Bodies come from :mod:`tests.integration.fuzz_bodies`: the routes' fields with hostile values and
unknown keys. The property, for every body: the answer is a 200 whose content has the route's shape
(text or choices, a known finish reason), or a 4xx with the shared error body whose message names a
field; never a 5xx, never a hang. After the run the server still answers a fixed greedy prompt as it
did before, reports healthy, and its KV pool is idle.

The runs are derandomized (the same bodies on every run) and bounded in examples; a failure prints
the body that caused it, shrunk, and the server's answer. The module has its own server: a body that
breaks it must not fail the rest of the suite, and once it is broken no later body is counted (each
is rejected), so the body reported is the one that broke it. Bodies that broke the server once are
replayed as they were found, after the generated ones.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, event, given, note, reject, settings

from .conftest import ServerProcess, pool_is_idle
from .fuzz_bodies import MAX_GEN, chat_body, completion_body, encode, generate_body

TIMEOUT = (5.0, 60.0)  # connect, read: a request that hangs fails the property
PROBE = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
NATIVE_FINISH = {"length", "stop"}
OPENAI_FINISH = {"length", "stop", "tool_calls"}
# a few seconds per route on two idle cores, about 30 s on busy ones; chat bodies cost the most
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess()
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def before(server) -> dict[str, Any]:
    """The greedy probe's answer before any fuzzing."""
    r = requests.post(server.url + "/generate", json=PROBE, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def serving(server) -> bool:
    try:
        return requests.get(server.url + "/health", timeout=10).status_code == 200
    except requests.RequestException:
        return False


def send(server, path: str, body: dict[str, Any]) -> requests.Response:
    if not serving(server):
        reject()  # broken by an earlier body: this one proves nothing
    data = encode(body)
    note(f"POST {path} {data[:2000]!r}")
    try:
        r = requests.post(server.url + path, data=data, headers={"content-type": "application/json"},
                          timeout=TIMEOUT, stream=True)
        r.content  # noqa: B018 - reads the whole (possibly streamed) body within the timeout
    except requests.Timeout:
        pytest.fail(f"no answer within {TIMEOUT[1]} s to POST {path} {data[:2000]!r}")
    note(f"-> {r.status_code} {r.text[:2000]}")
    event(f"status {r.status_code}")  # shown by --hypothesis-show-statistics
    return r


def send_plain(server, path: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(server.url + path, data=encode(body), headers={"content-type": "application/json"},
                         timeout=TIMEOUT)


# ---- the property --------------------------------------------------------------------------------
def check_answer(r: requests.Response, body: dict[str, Any], shape) -> None:
    assert r.status_code < 500, f"server error {r.status_code}: {r.text[:2000]}"
    if r.status_code == 200:
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            for chunk in sse_chunks(r.text):
                shape(chunk, streamed=True)
        else:
            shape(r.json(), streamed=False)
        return
    check_refusal(r, body)


def check_refusal(r: requests.Response, body: dict[str, Any]) -> None:
    assert r.status_code in (400, 404, 413), f"unexpected status {r.status_code}: {r.text[:2000]}"
    err = r.json()["error"]
    message, param = err["message"], err["param"]
    assert isinstance(message, str) and message
    assert param is None or isinstance(param, str)
    if param is not None:
        assert param.split(".")[0].split("[")[0] in message, f"message does not name {param!r}: {message}"
    else:
        named = {"body", "json", *keys_of(body)}
        assert any(name.lower() in message.lower() for name in named if name), f"no field named: {message}"


def keys_of(value: Any) -> set[str]:
    if isinstance(value, dict):
        return {str(k) for k in value} | {k for v in value.values() for k in keys_of(v)}
    if isinstance(value, list):
        return {k for v in value for k in keys_of(v)}
    return set()


def sse_chunks(text: str) -> list[dict[str, Any]]:
    """The JSON events of a stream; it must end with [DONE]. An error event must be a 4xx's."""
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"stream does not end with [DONE]: {text[-500:]!r}"
    chunks = [json.loads(e) for e in events[:-1]]
    for c in chunks:
        if "error" in c:
            assert 400 <= c["error"]["code"] < 500, f"error event in stream: {c}"
    return [c for c in chunks if "error" not in c]


def native_shape(out: Any, *, streamed: bool) -> None:
    for item in out if isinstance(out, list) else [out]:
        assert isinstance(item["text"], str) and isinstance(item["output_ids"], list)
        reason = item["meta_info"]["finish_reason"]
        if reason is not None or not streamed:
            assert reason["type"] in NATIVE_FINISH, f"finish_reason {reason}"
            assert item["meta_info"]["completion_tokens"] <= MAX_GEN


def openai_shape(kind: str):
    def shape(out: Any, *, streamed: bool) -> None:
        assert out["object"] == (f"{kind}.chunk" if streamed and kind == "chat.completion" else kind)
        assert isinstance(out["choices"], list)
        assert streamed or out["choices"], "no choices"
        for choice in out["choices"]:
            assert isinstance(choice["index"], int)
            reason = choice["finish_reason"]
            assert (streamed and reason is None) or reason in OPENAI_FINISH, f"finish_reason {reason}"
            if kind == "text_completion":
                assert isinstance(choice["text"], str)
            elif not streamed:
                msg = choice["message"]
                assert msg["role"] == "assistant"
                assert isinstance(msg["content"], str) or msg.get("tool_calls")
        if not streamed:
            assert out["usage"]["completion_tokens"] <= MAX_GEN * len(out["choices"])

    return shape


# ---- the runs ------------------------------------------------------------------------------------
def test_fuzz_generate(server, before):
    @FUZZ
    @given(body=generate_body())
    def run(body: dict[str, Any]) -> None:
        check_answer(send(server, "/generate", body), body, native_shape)

    run()


def test_fuzz_completions(server, before):
    @FUZZ
    @given(body=completion_body())
    def run(body: dict[str, Any]) -> None:
        check_answer(send(server, "/v1/completions", body), body, openai_shape("text_completion"))

    run()


def test_fuzz_chat_completions(server, before):
    @settings(FUZZ, max_examples=40)
    @given(body=chat_body())
    def run(body: dict[str, Any]) -> None:
        check_answer(send(server, "/v1/chat/completions", body), body, openai_shape("chat.completion"))

    run()


# ---- bodies the fuzzing found, minimised ---------------------------------------------------------
HUGE = 10**30
SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
CHAT = [{"role": "user", "content": "hi"}]
FOUND = {
    "priority-huge": ("/generate", {"text": "hi", "priority": HUGE, "sampling_params": {"max_new_tokens": 1}}),
    "top-k-huge": ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "top_k": HUGE}}),
    "stream-interval-huge": (
        "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "stream_interval": HUGE}}
    ),
    "custom-params-huge-int": (
        "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "custom_params": {"a": HUGE}}}
    ),
    "chat-top-k-2**64": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "top_k": 2**64}),
    "json-schema-tiny-repetition-penalty": (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 3, "repetition_penalty": 1e-62, "json_schema": SCHEMA}},
    ),
}
SHAPES = {"/generate": native_shape, "/v1/chat/completions": openai_shape("chat.completion")}
# top_k in [2**63, 2**64): it crosses to the scheduler, whose process then dies. Last in the module.
KILLER = ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "top_k": 2**63}})


@pytest.mark.parametrize("case", list(FOUND))
def test_found_bodies(server, case):
    path, body = FOUND[case]
    check_answer(send_plain(server, path, body), body, SHAPES[path])
    assert serving(server)


def test_server_unchanged_after_fuzzing(server, before):
    """The same greedy answer, healthy, and nothing left in the KV pool."""
    import time

    r = requests.post(server.url + "/generate", json=PROBE, timeout=60)
    assert r.status_code == 200, r.text
    assert (r.json()["text"], r.json()["output_ids"]) == (before["text"], before["output_ids"])
    assert serving(server)
    deadline = time.time() + 15
    while not pool_is_idle(info := requests.get(server.url + "/get_server_info", timeout=10).json()):
        assert time.time() < deadline, f"KV pool not idle: {info['live']}"
        time.sleep(0.2)


def test_found_body_that_killed_the_scheduler(server):
    path, body = KILLER
    check_answer(send_plain(server, path, body), body, native_shape)
    assert serving(server), requests.get(server.url + "/health", timeout=10).text

