"""``phloem bench serving`` against a real ``phloem serve`` (default model, CPU), every dataset, tiny sizes.

Each run's report must carry every field, have no failures, and agree with the server's own
counters on ``/metrics`` (requests, prompt tokens, generated tokens).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from phloem.bench import cli
from phloem.bench.report import parse_prometheus

pytest.importorskip("aiohttp")

READY_TIMEOUT_S = 120
TINY = {
    "random": ["--num-prompts", "3", "--random-input-len", "24", "--random-output-len", "4"],
    "shared-prefix": [
        "--num-groups",
        "2",
        "--prompts-per-group",
        "2",
        "--prefix-len",
        "64",
        "--question-len",
        "8",
        "--output-len",
        "4",
    ],
    "multi-turn": [
        "--num-conversations",
        "2",
        "--num-turns",
        "2",
        "--turn-len",
        "12",
        "--system-len",
        "8",
        "--output-len",
        "4",
    ],
    "agent": [
        "--num-agents",
        "2",
        "--num-steps",
        "2",
        "--task-len",
        "8",
        "--tool-result-len",
        "12",
        "--agent-output-len",
        "4",
    ],
    "json-schema": ["--num-prompts", "2", "--json-input-len", "16", "--json-output-len", "48"],
}
EXPECTED_REQUESTS = {"random": 3, "shared-prefix": 4, "multi-turn": 4, "agent": 4, "json-schema": 2}
REPORT_FIELDS = [
    "completed",
    "failed",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "total_output_tokens_server",
    "total_output_tokens_retokenized",
    "token_count_mismatch",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "cache_hit_rate",
    "errors",
] + [f"{s}_{k}_ms" for k in ("ttft", "itl", "tpot", "e2e_latency") for s in ("mean", "median", "p90", "p99")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except OSError:
        return 0, ""


@pytest.fixture(scope="module")
def server():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "phloem", "serve", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while get(url + "/health")[0] != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(
                f"phloem serve did not become healthy: {proc.stderr.read()[-2000:] if proc.stderr else ''}"
            )
        time.sleep(1)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def counters(url: str) -> dict[str, float]:
    return parse_prometheus(get(url + "/metrics")[1])


def settled_delta(url: str, before: dict[str, float], key: str, want: float) -> float:
    """The counter's growth since ``before``, polled briefly (requests are counted as they finish)."""
    deadline = time.monotonic() + 5
    while True:
        delta = counters(url).get(key, 0.0) - before.get(key, 0.0)
        if delta == want or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["phloem", "openai"])
@pytest.mark.parametrize("dataset", list(TINY))
def test_bench_serving_dataset(server, tmp_path, dataset, backend):
    out = tmp_path / "report.jsonl"
    argv = ["serving", "--base-url", server, "--backend", backend, "--dataset", dataset, *TINY[dataset]]
    argv += ["--max-concurrency", "4", "--warmup-requests", "0", "--output-file", str(out), "--disable-tqdm"]
    before = counters(server)
    rc = cli.main(argv)
    (report,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rc == 0, report["errors"]
    assert all(k in report for k in REPORT_FIELDS), sorted(set(REPORT_FIELDS) - set(report))
    assert report["completed"] == EXPECTED_REQUESTS[dataset] and report["failed"] == 0
    assert report["errors"] == [] and not report["token_count_mismatch"]
    assert report["cache_hit_rate_source"] == "metrics" and 0.0 <= report["cache_hit_rate"] <= 1.0
    n = report["completed"]
    assert settled_delta(server, before, "num_requests_total", n) == n
    assert (
        settled_delta(server, before, "generation_tokens_total", report["total_output_tokens_server"])
        == report["total_output_tokens_server"]
    )
    assert (
        settled_delta(server, before, "prompt_tokens_total", report["total_input_tokens"])
        == report["total_input_tokens"]
    )
    if dataset == "json-schema":
        assert report["json_valid_rate"] == 1.0
    else:
        assert report["total_output_tokens_server"] == 4 * n  # ignore_eos: exactly max_new_tokens each
    if dataset == "shared-prefix":
        assert report["cache_hit_rate"] > 0
    assert os.path.getsize(out) > 0
