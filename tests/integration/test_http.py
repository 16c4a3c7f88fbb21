"""The HTTP server on the default model: native /generate, the OpenAI client, admin routes,
bad input, disconnects, auth, metrics and load."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_server_bad_inputs import CASES as ALL_CASES

from .conftest import ServerProcess

# Cases whose failure is staged by the fake tokenizer manager of the unit tests.
FAKE_ONLY = {"oai-chat-template-failure"}
CASES = [c for c in ALL_CASES if c[0] not in FAKE_ONLY]

META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "num_retractions", "e2e_latency"}


def post(server, path, body, **kw):
    return requests.post(server.url + path, json=body, timeout=120, **kw)


def wait_idle(server, timeout=15.0) -> dict:
    deadline = time.time() + timeout
    while True:
        live = requests.get(server.url + "/get_server_info", timeout=10).json()["live"]
        if live["num_running_reqs"] == 0 and live["num_queue_reqs"] == 0 and live["token_usage"] == 0.0:
            return live
        if time.time() > deadline:
            return live
        time.sleep(0.2)


def test_generate_single_batch_logprobs_and_n(server):
    r = post(server, "/generate", {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200
    out = r.json()
    assert "Paris" in out["text"] and META_KEYS <= out["meta_info"].keys()
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) == 8

    r = post(server, "/generate", {"text": ["1, 2, 3,", "a, b, c,"], "sampling_params": {"max_new_tokens": 4}})
    assert isinstance(r.json(), list) and len(r.json()) == 2

    r = post(server, "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 3, "n": 2},
                                   "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True})
    outs = r.json()
    assert len(outs) == 2
    for o in outs:
        lps = o["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in lps] == o["output_ids"] and all(isinstance(t[2], str) for t in lps)
        assert len(o["meta_info"]["output_top_logprobs"]) == 3


def test_generate_stream_is_cumulative_sse(server):
    with requests.post(server.url + "/generate", json={"text": "Count: 1, 2,", "stream": True,
                       "sampling_params": {"max_new_tokens": 6, "temperature": 0}}, stream=True, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(chunks[-1]["output_ids"]) == 6


def test_openai_client_chat_stream_completions_n_logprobs_usage(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens == len(chat.choices[0].logprobs.content)
    assert chat.usage.prompt_tokens_details.cached_tokens is not None
    parts = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                                max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert text == chat.choices[0].message.content
    assert parts[-1].usage.completion_tokens == chat.usage.completion_tokens
    comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, n=2,
                                     temperature=0.8, seed=3, logprobs=2)
    assert len(comp.choices) == 2 and comp.usage.completion_tokens > 0
    assert all(len(c.logprobs.tokens) > 0 for c in comp.choices)


def test_admin_routes(server):
    assert requests.get(server.url + "/health").status_code == 200
    assert requests.get(server.url + "/health_generate", timeout=60).status_code == 200
    info = requests.get(server.url + "/get_model_info").json()
    assert info["is_generation"] and "model_path" in info
    assert "max_total_num_tokens" in requests.get(server.url + "/server_info").json()
    toks = post(server, "/v1/tokenize", {"prompt": "hello world"}).json()["tokens"]
    assert post(server, "/v1/detokenize", {"tokens": toks}).json()["text"] == "hello world"
    wait_idle(server)
    assert post(server, "/flush_cache", {}).status_code == 200


def _abort_after_first_tokens(server, rid: str) -> None:
    deadline = time.time() + 60
    while time.time() < deadline:  # until the request is decoding
        live = requests.get(server.url + "/get_server_info", timeout=10).json()["live"]
        if live["num_running_reqs"] > 0:
            break
        time.sleep(0.05)
    time.sleep(0.3)
    assert post(server, "/abort_request", {"rid": rid}).json() == {"success": True}


def test_abort_by_the_caller_answers_200_with_finish_reason_abort(server):
    """SGLang's wire contract: the aborted request is an answer, not an error, streamed or not."""
    from concurrent.futures import ThreadPoolExecutor

    params = {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(post, server, "/generate", {"text": "Count: 1, 2,", "rid": "ab-1", "sampling_params": params})
        _abort_after_first_tokens(server, "ab-1")
        r = plain.result()
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "aborted by request"}
    assert 0 < meta["completion_tokens"] < 2000 and r.json()["text"]

    body = {"text": "Count: 1, 2,", "rid": "ab-2", "stream": True, "sampling_params": params}
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(post, server, "/generate", body)
        _abort_after_first_tokens(server, "ab-2")
        r = streamed.result()
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert not any("error" in e for e in events) and r.text.rstrip().endswith("data: [DONE]")
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted by request"}
    assert wait_idle(server)["num_running_reqs"] == 0


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_4xx_and_server_stays_healthy(server, case):
    _, path, body, status, needle = case
    if isinstance(body, bytes):
        r = requests.post(server.url + path, data=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        r = post(server, path, body)
    assert 400 <= r.status_code < 500, r.text
    assert needle.lower() in r.text.lower()
    if path.startswith("/v1/") and "sampling_params" not in json.dumps(body, default=str):
        assert "max_new_tokens" not in r.text  # OpenAI clients hear of their own fields only


def test_duplicate_rids_are_refused_as_the_engine_refuses_them(server):
    """``/generate`` expands a call with the Engine's code: the same refusal, as a 400."""
    for rids, sampling, dup in ((["twin", "twin"], {}, "twin"), (["twin", "twin-0"], [{"n": 2}, {}], "twin-0")):
        r = post(server, "/generate", {"text": ["One,", "Two,"], "rid": rids, "sampling_params": sampling})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["message"]) == ("rid", f"rid: duplicate request id '{dup}'")
    r = post(server, "/generate", {"text": "One,", "rid": "twin", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "twin"


def test_health_generate_after_bad_inputs(server):
    assert requests.get(server.url + "/health_generate", timeout=60).status_code == 200


def test_prompt_longer_than_context_is_400(server):
    r = post(server, "/generate", {"input_ids": [100] * 9000, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "context" in r.text


def test_huge_prompts_are_refused_quickly_without_holding_a_short_one(server):
    """Prompts far over the context (megabytes: refused from their byte length; a few hundred
    kilobytes: from a prefix) get a 400 naming the client's field within seconds, while a short
    request sent among them is served and /health answers."""
    prose = "The quick brown fox jumps over the lazy dog, 12 times. "

    def text(nbytes: int) -> str:
        return (prose * (nbytes // len(prose) + 1))[:nbytes]

    huge = [
        ("/generate", {"text": text(3_000_000), "sampling_params": {"max_new_tokens": 1}}, "text"),
        ("/generate", {"text": text(3_000_000), "sampling_params": {"max_new_tokens": 1}}, "text"),
        ("/generate", {"text": text(300_000), "sampling_params": {"max_new_tokens": 1}}, "text"),
        ("/v1/completions", {"model": "default", "prompt": text(3_000_000), "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": text(3_000_000)}]}, "messages"),
    ]

    async def main() -> tuple[list[tuple[int, dict, float]], int]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

            async def send(path: str, body: dict) -> tuple[int, dict, float]:
                start = time.perf_counter()
                async with session.post(server.url + path, json=body) as r:
                    return r.status, await r.json(), time.perf_counter() - start

            async def health() -> int:
                await asyncio.sleep(0.2)
                async with session.get(server.url + "/health") as r:
                    return r.status

            short = send("/generate", {"text": "Count: 1, 2,", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
            results = await asyncio.gather(*(send(p, b) for p, b, _ in huge), short, health())
            return list(results[: len(huge) + 1]), results[-1]

    results, health_status = asyncio.run(main())
    for (path, _, field), (status, body, seconds) in zip(huge, results, strict=False):
        message = body["error"]["message"]
        assert status == 400 and body["error"]["param"] == field, (path, body)
        assert message.startswith(f"{field}: the prompt has at least "), message
        assert message.endswith("the model's context length is 8192")
        assert seconds < 15, (path, seconds)  # encoding all of 3 MB alone took several seconds
    short_status, short_body, _ = results[-1]
    assert short_status == 200 and short_body["meta_info"]["completion_tokens"] == 4
    assert health_status == 200


def test_disconnect_mid_stream_frees_kv(server):
    wait_idle(server)
    with requests.post(server.url + "/generate", json={"text": "Tell a long story.", "stream": True,
                       "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}, stream=True, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    live = wait_idle(server)
    assert live["num_running_reqs"] == 0 and live["token_usage"] == 0.0


def test_metrics_parse_and_move(server):
    def families():
        return {f.name: f for f in text_string_to_metric_families(requests.get(server.url + "/metrics").text)}

    before = families()
    post(server, "/generate", {"text": "Metrics test", "sampling_params": {"max_new_tokens": 3}})
    schema = '{"type": "object", "properties": {"metric_probe": {"type": "boolean"}}, "required": ["metric_probe"]}'
    post(server, "/generate", {"text": "JSON:", "sampling_params": {"max_new_tokens": 16, "json_schema": schema}})
    time.sleep(1.5)
    after = families()
    compiles = after["phloem:grammar_compilation_time_seconds"]
    assert sum(s.value for s in compiles.samples if s.name.endswith("_count")) >= 1
    for name in ("phloem:num_running_reqs", "phloem:token_usage", "phloem:cache_hit_rate",
                 "phloem:time_to_first_token_seconds", "phloem:e2e_request_latency_seconds"):
        assert name in after, name

    def total(fams, name):
        return sum(s.value for s in fams[name].samples if s.name.endswith("_total") or s.name == name)

    assert total(after, "phloem:generation_tokens") > total(before, "phloem:generation_tokens")


def test_load_200_streams_with_client_aborts(server):
    rng = random.Random(1)

    async def one(session, i):
        n = rng.randint(1, 16)
        drop = rng.random() < 0.1
        body = {"text": f"Item {i}: " + "word " * rng.randint(1, 40), "stream": True,
                "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}
        async with session.post(server.url + "/generate", json=body) as resp:
            assert resp.status == 200
            last = None
            seen = 0
            async for line in resp.content:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                last = json.loads(line[6:])
                seen += 1
                if drop and seen >= 1:
                    return None
            return n, last

    async def main():
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await asyncio.gather(*(one(session, i) for i in range(200)))

    results = asyncio.run(main())
    done = [r for r in results if r is not None]
    assert len(done) >= 150
    for n, last in done:
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        assert last["meta_info"]["completion_tokens"] == n == len(last["output_ids"])
    live = wait_idle(server, timeout=30)
    assert live["num_running_reqs"] == 0 and live["token_usage"] == 0.0


def _strings(value, path=""):
    """Every (path, string) in a JSON value, keys included."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield f"{path}.{k}", str(k)
            yield from _strings(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}[{i}]")
    elif isinstance(value, str):
        yield path, value


def test_api_key_guards_all_but_health_and_metrics_and_never_leaks(tmp_path):
    import uuid

    secret = f"sk-{uuid.uuid4().hex}"
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        srv = ServerProcess("--api-key", secret, "--load-format", "dummy", "--max-total-tokens", "2048",
                            "--log-requests", log_level="debug", output=out)  # fmt: skip
        try:
            srv.wait_ready()
            auth = {"Authorization": f"Bearer {secret}"}
            assert requests.get(srv.url + "/health").status_code == 200
            assert requests.get(srv.url + "/metrics").status_code == 200
            body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
            assert requests.post(srv.url + "/generate", json=body).status_code == 401
            assert requests.post(srv.url + "/generate", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
            ok = requests.post(srv.url + "/generate", json=body, headers=auth)
            assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 1
            # every field of the server info, and every other route that describes the server
            info = requests.get(srv.url + "/get_server_info", headers=auth).json()
            assert info["api_key"] == "<redacted>"
            for path, text in _strings(info):
                assert secret not in text, path
            for route in ("/server_info", "/get_model_info", "/v1/models", "/metrics", "/openapi.json",
                          "/health_generate"):  # fmt: skip
                r = requests.get(srv.url + route, headers=auth, timeout=60)
                assert r.status_code == 200 and secret not in r.text, route
            bad = requests.post(srv.url + "/generate", json={"text": 5}, headers=auth)
            assert bad.status_code == 400 and secret not in bad.text
        finally:
            assert srv.stop() == 0
    text = log.read_text()
    assert "POST /generate" in text  # the log did record requests
    assert secret not in text
