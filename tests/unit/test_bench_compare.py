"""benchmarks/compare.py: run schedule, medians and ratios, peer commands, and a whole run against
two small fake OpenAI servers (no model, no subprocess)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402
from phloem.bench import compare  # noqa: E402


# ---- pure pieces ------------------------------------------------------------------------------------
def test_schedule_alternates_order_and_gives_every_run_a_fresh_seed():
    runs = compare.schedule([1, 8], rounds=2, names=["phloem", "llama-server"], seed=10)
    assert [(c, k, seed) for c, k, seed, _ in runs] == [(1, 0, 10), (1, 1, 11), (8, 0, 12), (8, 1, 13)]
    firsts = [order[0] for *_, order in runs]
    assert firsts == ["phloem", "llama-server", "phloem", "llama-server"]
    assert all(sorted(order) == ["llama-server", "phloem"] for *_, order in runs)


def test_schedule_with_one_round_alternates_across_concurrencies():
    runs = compare.schedule([1, 8, 32], rounds=1, names=["a", "b"], seed=0)
    assert [order for *_, order in runs] == [["a", "b"], ["b", "a"], ["a", "b"]]


def rep(tput: float, ttft: float = 100.0, failed: int = 0) -> dict[str, Any]:
    return {"output_throughput": tput, "median_ttft_ms": ttft, "mean_ttft_ms": ttft, "failed": failed}


def test_ratio_table_takes_medians_over_rounds():
    reports = {
        "phloem": [rep(10, 300), rep(30, 100), rep(20, 200)],
        "llama-server": [rep(5, 50), rep(15, 150)],
    }
    text, ratios = compare.ratio_table(reports, "llama-server")
    tput = ratios["output_throughput"]
    assert (tput["phloem"], tput["llama-server"], tput["ratio"]) == (20, 10, 2.0)
    assert tput["higher_is_better"] is True
    ttft = ratios["median_ttft_ms"]
    assert (ttft["ratio"], ttft["higher_is_better"]) == (2.0, False)
    assert ratios["cache_hit_rate"]["ratio"] is None  # missing on both sides: no ratio, no crash
    assert ratios["total_input_tokens"]["higher_is_better"] is None
    assert "output tok/s" in text and "median TTFT ms" in text and "failed requests" in text


def test_ratio_table_skips_division_by_zero_and_counts_failures():
    text, ratios = compare.ratio_table({"phloem": [rep(3, failed=2)], "hf": [rep(0, failed=1)]}, "hf")
    assert ratios["output_throughput"]["ratio"] is None
    assert "{'phloem': 2, 'hf': 1}" in text


def test_by_concurrency_groups_runs_in_order():
    runs = [
        {"server": s, "max_concurrency": c, "report": {"x": i}}
        for i, (s, c) in enumerate([("a", 8), ("b", 8), ("b", 1), ("a", 1), ("a", 8)])
    ]
    grouped = compare.by_concurrency(runs)
    assert list(grouped) == [8, 1]
    assert grouped[8] == {"a": [{"x": 0}, {"x": 4}], "b": [{"x": 1}]}


def test_peer_commands():
    cmd, env = compare.peer_command("llama-server", 4321, 32, 1, ["--flash-attn", "on"])
    assert cmd[0] == "bash" and cmd[1].endswith(os.path.join("peers", "llama_server.sh"))
    assert cmd[2:] == ["4321", "--flash-attn", "on"] and os.path.exists(cmd[1])
    assert env["SLOTS"] == "32" and env["THREADS"] == "1" and "PYTHON" in env
    cmd, env = compare.peer_command("hf", 4321, 8, None, [])
    assert cmd[1].endswith("hf_server.py") and os.path.exists(cmd[1])
    assert cmd[2:] == ["--port", "4321", "--max-batch", "8"] and env == {}
    cmd, _ = compare.peer_command("hf", 4321, 8, 2, [])
    assert cmd[-2:] == ["--threads", "2"]
    cmd, env = compare.peer_command("llama-cpp-python", 1, 1, None, [])
    assert os.path.exists(cmd[1]) and "THREADS" not in env
    serve = compare.phloem_command(4000, 1, ["--quantization", "int8"])
    assert serve[1:4] == ["-m", "phloem", "serve"] and serve[-2:] == ["--quantization", "int8"]
    assert serve[serve.index("--port") + 1] == "4000" and serve[serve.index("--cpu-threads") + 1] == "1"
    assert "--cpu-threads" not in compare.phloem_command(4000, None, [])


# ---- a whole run against fake servers --------------------------------------------------------------
class FakeOpenAI:
    """Streams `` the`` per requested token; logs (server, prompt) in arrival order to a shared list."""

    def __init__(self, name: str, log: list[tuple[str, str]], loop: asyncio.AbstractEventLoop) -> None:
        self.name, self.log, self.loop, self.url = name, log, loop, ""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0.0
        self.log.append((self.name, body["prompt"]))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for _ in range(n):
            chunk = {"choices": [{"index": 0, "text": " the", "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"prompt_tokens": 8, "completion_tokens": n}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": self.name}]})

    async def serve(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return runner


@pytest.fixture
def fakes():
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    log: list[tuple[str, str]] = []
    servers = [FakeOpenAI(n, log, loop) for n in ("phloem", "peer")]
    runners = [asyncio.run_coroutine_threadsafe(s.serve(), loop).result(10) for s in servers]
    yield servers, log
    for r in runners:
        asyncio.run_coroutine_threadsafe(r.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


def test_main_alternates_sends_identical_prompts_and_writes_json(fakes, tmp_path):
    (phloem, peer), log = fakes
    out = tmp_path / "run.json"
    argv = [
        "--phloem-url", phloem.url, "--peer", f"url:{peer.url}",
        "--dataset", "random", "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "3",
        "--max-concurrency", "1,2", "--rounds", "2", "--warmup-requests", "0", "--disable-tqdm",
        "--output", str(out),
    ]  # fmt: skip
    assert compare.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["command"].startswith("python benchmarks/compare.py --phloem-url")
    assert record["servers"] == ["phloem", "peer"] and len(record["git_commit"]) == 40
    runs = record["runs"]
    assert [(r["server"], r["max_concurrency"], r["round"]) for r in runs[:4]] == [
        ("phloem", 1, 0), ("peer", 1, 0), ("peer", 1, 1), ("phloem", 1, 1)
    ]  # fmt: skip
    assert all(r["report"]["completed"] == 2 and len(r["load_before"]) == 3 for r in runs)
    # requests arrive in the scheduled order, two per run, and both servers get the same prompts
    assert [name for name, _ in log] == [r["server"] for r in runs for _ in range(2)]
    prompts = {n: [p for s, p in log if s == n] for n in ("phloem", "peer")}
    assert sorted(prompts["phloem"]) == sorted(prompts["peer"]) and len(set(prompts["peer"])) == 8
    summary = record["summary"]
    assert set(summary) == {"1", "2"}
    assert summary["2"]["total_output_tokens"]["ratio"] == 1.0


def test_write_plot_draws_every_server(tmp_path):
    pytest.importorskip("matplotlib")

    def record(conc: int) -> dict[str, Any]:
        runs = [
            {"server": s, "max_concurrency": conc, "report": rep(t * conc)}
            for s, t in [("phloem", 5), ("hf", 2)]
        ]
        return {"dataset": "random", "servers": ["phloem", "hf"], "runs": runs}

    path = tmp_path / "p.png"
    compare.write_plot([record(1), record(8)], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
