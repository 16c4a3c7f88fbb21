"""The serving benchmark client against a small fake aiohttp server (no model).

The fake server streams `` the`` once per requested token; words in the prompt pick a failure:
``FAIL500`` (HTTP 500), ``ERREVENT`` (an error event mid-stream), ``EMPTY`` (200 with nothing),
``ABORT`` (finish_reason abort), ``LIAR`` (the server over-counts its tokens by 3x).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402
from phloem.bench import cli  # noqa: E402
from phloem.bench.client import OpenAIBackend, PhloemBackend, Result  # noqa: E402
from phloem.bench.datasets import Session, Turn  # noqa: E402
from phloem.bench.report import format_report, parse_prometheus, percentile, summarize  # noqa: E402
from phloem.bench.runner import RunOptions, run_sessions  # noqa: E402


class FakeServer:
    """Records prompts and the peak number of requests in flight; counts tokens for /metrics."""

    def __init__(self) -> None:
        self.prompts: list[Any] = []
        self.in_flight = self.peak = 0
        self.prompt_total = self.cached_total = 0
        self.loop = asyncio.new_event_loop()
        self.url = ""

    # -- helpers
    def _start(self, text: str) -> None:
        self.prompts.append(text)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        self.prompt_total += 10
        self.cached_total += 5

    async def _sse(self, request: web.Request, events: list[Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for e in events:
            await asyncio.sleep(0.002)
            await resp.write(b"data: " + json.dumps(e).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        self.in_flight -= 1
        return resp

    # -- routes
    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        text, n = body["text"], body["sampling_params"]["max_new_tokens"]
        self._start(text)
        if "FAIL500" in text:
            self.in_flight -= 1
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if "EMPTY" in text:
            return await self._sse(request, [])
        events = []
        for i in range(1, n + 1):
            counted = 3 * i if "LIAR" in text else i
            meta = {
                "prompt_tokens": 10,
                "completion_tokens": counted,
                "cached_tokens": 5,
                "finish_reason": None,
            }
            if i == n:
                meta["finish_reason"] = (
                    {"type": "abort", "message": "x"} if "ABORT" in text else {"type": "length"}
                )
            events.append({"text": " the" * i, "meta_info": meta})
            if "ERREVENT" in text and i == 2:
                events.append({"error": {"message": "engine failure"}})
                break
        return await self._sse(request, events)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        key = "delta" if "messages" in body else "text"
        self._start(json.dumps(body.get("messages") or body.get("prompt")))
        n = body["max_tokens"]

        def choice(piece: str) -> dict[str, Any]:
            return {"index": 0, key: {"content": piece} if key == "delta" else piece, "finish_reason": None}

        events: list[Any] = [{"choices": [choice(" the")]} for _ in range(n)]
        events.append({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": n}})
        return await self._sse(request, events)

    async def metrics(self, request: web.Request) -> web.Response:
        text = (
            f'phloem:prompt_tokens_total{{model_name="m"}} {self.prompt_total}.0\n'
            f'phloem:cached_tokens_total{{model_name="m"}} {self.cached_total}.0\n'
        )
        return web.Response(text=text)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake-model"}]})

    async def tokenizer(self, request: web.Request) -> web.Response:
        """The default model's tokenizer, as phloem's ``GET /tokenizer`` exports it."""
        from phloem.runtime.model_files import resolve_model
        from phloem.runtime.tokenizer.tokenizer import load_tokenizer

        return web.json_response(load_tokenizer(resolve_model(None)).to_hf_files())

    # -- lifecycle
    def start(self) -> None:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/tokenizer", self.tokenizer)
        self.runner = web.AppRunner(app)
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(10)

    async def _serve(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def tok():
    from phloem.runtime.model_files import resolve_model
    from phloem.runtime.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


@pytest.fixture
def server():
    s = FakeServer()
    s.start()
    yield s
    s.stop()


def raw(sid: int, text: str, n: int = 4) -> Session:
    return Session(sid, (Turn(text, n),))


def run(backend_cls: Any, url: str, sessions: list[Session], tok: Any, **opt: Any) -> dict[str, Any]:
    async def go() -> tuple[Any, float]:
        backend = backend_cls(url)
        try:
            return await run_sessions(backend, sessions, tok, RunOptions(progress=False, **opt))
        finally:
            await backend.close()

    results, duration = asyncio.run(go())
    return {"results": results, "report": summarize(results, duration)}


def test_success_counts_and_latencies(server, tok):
    out = run(PhloemBackend, server.url, [raw(i, f"hello {i}") for i in range(4)], tok)
    rep = out["report"]
    assert rep["completed"] == 4 and rep["failed"] == 0 and rep["errors"] == []
    assert rep["total_output_tokens"] == rep["total_output_tokens_server"] == 16
    assert rep["total_output_tokens_retokenized"] == 16 and not rep["token_count_mismatch"]
    assert rep["total_input_tokens"] == 40 and rep["cache_hit_rate"] == 0.5
    assert rep["cache_hit_rate_source"] == "responses"
    r = out["results"][0]
    assert r.ttft > 0 and r.latency >= r.ttft and len(r.itl) == 3
    assert rep["mean_tpot_ms"] > 0 and rep["p99_e2e_latency_ms"] >= rep["median_e2e_latency_ms"]


@pytest.mark.parametrize(
    ("word", "message"),
    [("FAIL500", "HTTP 500"), ("ERREVENT", "error event"), ("EMPTY", "empty response"), ("ABORT", "aborted")],
)
def test_failures_are_never_successes(server, tok, word, message):
    out = run(PhloemBackend, server.url, [raw(0, f"x {word}"), raw(1, "fine")], tok)
    rep = out["report"]
    assert rep["completed"] == 1 and rep["failed"] == 1
    assert any(message in e for e in rep["errors"])


def test_server_token_overcount_is_an_error(server, tok):
    rep = run(PhloemBackend, server.url, [raw(0, "a LIAR", n=8)], tok)["report"]
    assert rep["token_count_mismatch"] and any("mismatch" in e for e in rep["errors"])


def _counted(server_tokens: int, client_tokens: int) -> Result:
    return Result(0, 0, prompt_len=4, output_len=server_tokens, success=True, latency=1.0,
                  server_output_tokens=server_tokens, client_output_tokens=client_tokens)  # fmt: skip


def test_dummy_model_with_more_ids_than_its_tokenizer_is_excused_from_the_token_check():
    """Random weights of a 128k-vocabulary shape read through a 49k tokenizer emit ids that decode
    to nothing: the counts cannot agree, and the run must not fail on it; with the tokenizer's
    own vocabulary (or no sizes given) the same counts are an error."""
    results = [_counted(100, 40)]
    excused = summarize(results, 1.0, vocab=(128_256, 49_152))
    assert not excused["token_count_mismatch"] and excused["errors"] == []
    assert (
        excused["token_count_check"]
        == "not applicable: the model has 128,256 token ids, the tokenizer 49,152"
    )
    assert "Token count check" in format_report(excused)
    for vocab in ((49_152, 49_152), None):
        rep = summarize(results, 1.0, vocab=vocab)
        assert rep["token_count_mismatch"] and rep["token_count_check"] == "done"
        assert any("mismatch" in e for e in rep["errors"])
        assert "Token count check" not in format_report(rep)


def test_max_concurrency_is_respected(server, tok):
    run(PhloemBackend, server.url, [raw(i, f"p {i}", n=6) for i in range(8)], tok, max_concurrency=2)
    assert server.peak == 2


def test_turns_are_sequential_and_resend_history(server, tok):
    session = Session(0, (Turn("first", 3), Turn("second", 3)), chat=True, system="sys")
    out = run(PhloemBackend, server.url, [session], tok)
    assert out["report"]["completed"] == 2
    first, second = server.prompts
    assert "first" in first and "second" not in first
    assert "first" in second and " the the the" in second and "second" in second


def test_failed_turn_skips_the_rest_of_its_session(server, tok):
    session = Session(0, (Turn("FAIL500", 3), Turn("never sent", 3)), chat=True)
    rep = run(PhloemBackend, server.url, [session], tok)["report"]
    assert rep["failed"] == 2 and len(server.prompts) == 1


def test_openai_backend_completions_and_chat(server, tok):
    sessions = [raw(0, "plain"), Session(1, (Turn("hi", 4),), chat=True)]
    rep = run(OpenAIBackend, server.url, sessions, tok)["report"]
    assert rep["completed"] == 2 and rep["total_output_tokens_server"] == 8
    assert rep["total_output_tokens_retokenized"] == 8 and rep["errors"] == []


def test_cli_serving_writes_jsonl_and_plots(server, tmp_path):
    pytest.importorskip("matplotlib")
    out, plots = tmp_path / "out.jsonl", tmp_path / "plots"
    argv = ["serving", "--base-url", server.url, "--dataset", "random", "--num-prompts", "4"]
    argv += ["--random-input-len", "8", "--random-output-len", "3", "--max-concurrency", "1,2"]
    argv += ["--output-file", str(out), "--plot", str(plots), "--disable-tqdm"]
    assert cli.main(argv) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["max_concurrency"] for x in lines] == [1, 2]
    assert all(x["completed"] == 4 and x["cache_hit_rate_source"] == "metrics" for x in lines)
    assert lines[0]["cache_hit_rate"] == pytest.approx(0.5)
    names = sorted(os.listdir(plots))
    assert names == ["latency_vs_concurrency.png", "throughput_vs_concurrency.png", "ttft_cdf.png"]


def test_cli_serving_exit_code_on_failure(server):
    argv = ["serving", "--base-url", server.url + "/nope", "--num-prompts", "1", "--warmup-requests", "0"]
    assert cli.main([*argv, "--disable-tqdm", "--tokenizer", "default"]) == 1


def test_cli_serving_exit_code_when_the_tokenizer_cannot_be_fetched(server, capsys):
    argv = ["serving", "--base-url", server.url + "/nope", "--num-prompts", "1", "--warmup-requests", "0"]
    assert cli.main([*argv, "--disable-tqdm"]) == 2
    assert f"GET {server.url}/nope/tokenizer answered HTTP 404" in capsys.readouterr().err


def test_parse_prometheus_and_percentile():
    text = '# HELP x\nphloem:a_total{m="1"} 3.0\nphloem:b 2\nother 1\nphloem:h_bucket{le="1"} 4\n'
    assert parse_prometheus(text) == {"a_total": 3.0, "b": 2.0, "h_bucket": 4.0}
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5


class _LoggingTokenizer:
    """Counts words; logs every encode so the test can see when the client tokenized."""

    def __init__(self, log: list[tuple[str, str]]) -> None:
        self.log = log

    def encode(self, text: str) -> list[int]:
        self.log.append(("encode", text))
        return list(range(len(text.split())))

    def apply_chat_template(self, messages: list[dict[str, str]], **kw: Any) -> str:
        return " | ".join(m["content"] for m in messages)


class _LoggingBackend:
    """Answers every request with ``reply <sid>`` at once; logs each send."""

    def __init__(self, log: list[tuple[str, str]]) -> None:
        self.log = log

    async def send(self, req: Any) -> Any:
        from phloem.bench.client import Result

        self.log.append(("send", req.text))
        await asyncio.sleep(0)
        r = Result(req.sid, req.turn, req.prompt_len, req.output_len)
        r.success, r.text, r.server_output_tokens = True, f"reply {req.sid}", 2
        return r


def test_client_tokenizer_work_stays_outside_the_timed_window():
    """Every first turn is rendered and counted before the first send (the client's tokenizer
    would otherwise delay the first request by the time it takes to tokenize every prompt);
    outputs are retokenized only after the last reply; later turns still follow their replies."""
    log: list[tuple[str, str]] = []
    tok, backend = _LoggingTokenizer(log), _LoggingBackend(log)
    sessions = [raw(i, f"prompt number {i}") for i in range(5)]
    sessions.append(Session(9, (Turn("first question", 2), Turn("second question", 2)), chat=True))
    results, _ = asyncio.run(run_sessions(backend, sessions, tok, RunOptions(progress=False)))  # type: ignore[arg-type]
    kinds = [k for k, _ in log]
    first_send = kinds.index("send")
    last_send = len(kinds) - 1 - kinds[::-1].index("send")
    assert [t for k, t in log[:first_send]] == [*(f"prompt number {i}" for i in range(5)), "first question"]
    second = next(i for i, (k, t) in enumerate(log) if k == "encode" and t.endswith("second question"))
    assert log.index(("send", "first question")) < second < last_send  # rendered with the reply
    assert "reply 9 | second question" in log[second][1]
    after = log[last_send + 1 :]
    assert all(k == "encode" for k, _ in after)
    assert sorted(t for _, t in after) == sorted(r.text for r in results)
    assert all(r.success and r.client_output_tokens == 2 for r in results) and len(results) == 7
