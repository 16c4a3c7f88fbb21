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
    "json-schema": ["--num-prompts", "2", "--random-input-len", "32", "--random-output-len", "24"],
    "regex": ["--num-prompts", "2", "--random-input-len", "32", "--random-output-len", "24"],
}
EXPECTED_REQUESTS = {
    "random": 3,
    "shared-prefix": 4,
    "multi-turn": 4,
    "agent": 4,
    "json-schema": 2,
    "regex": 2,
}
OUTPUT_LEN = {"json-schema": 24, "regex": 24}  # the others: 4
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


def serve(*flags: str):
    """Start ``phloem serve`` with ``flags``; yields its URL once healthy, stops it afterwards."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "phloem", "serve", "--port", str(port), "--log-level", "warning", *flags]
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


@pytest.fixture(scope="module")
def server():
    yield from serve()


def export_tokenizer(folder) -> None:
    """The default model's tokenizer as a Hugging Face tokenizer folder (no weights)."""
    from phloem.runtime.model_files import resolve_model
    from phloem.runtime.tokenizer.tokenizer import load_tokenizer

    files = load_tokenizer(resolve_model(None)).to_hf_files()
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(files["tokenizer_json"]))
    (folder / "tokenizer_config.json").write_text(json.dumps(files["tokenizer_config"]))


@pytest.fixture(scope="module")
def dummy_server(tmp_path_factory):
    """Random weights of the default shape with a tokenizer folder, as a GPU server is started."""
    folder = tmp_path_factory.mktemp("dummy") / "tok"
    export_tokenizer(folder)
    yield from serve("--load-format", "dummy", "--tokenizer-path", str(folder))


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
    # every reply runs to its length: ignore_eos, or a grammar too long to finish
    assert report["total_output_tokens_server"] == OUTPUT_LEN.get(dataset, 4) * n
    if dataset in ("json-schema", "regex"):
        assert report["constrained_valid_rate"] == 1.0 and report["constrained_invalid"] == 0
    else:
        assert report["constrained_valid_rate"] is None
    if dataset == "shared-prefix":
        assert report["cache_hit_rate"] > 0
    assert os.path.getsize(out) > 0


def run_bench(url: str, out, *args: str) -> dict:
    argv = ["serving", "--base-url", url, *args, "--warmup-requests", "0", "--disable-tqdm"]
    assert cli.main([*argv, "--output-file", str(out)]) == 0
    (report,) = [json.loads(line) for line in out.read_text().splitlines()]
    return report


@pytest.mark.slow
def test_constrained_and_plain_runs_send_and_make_the_same_tokens(server, tmp_path):
    """With the same length flags, random, json-schema and regex count the same prompt tokens on
    the server and produce the same output tokens: their output tok/s compare."""
    flags = ["--num-prompts", "3", "--random-input-len", "48", "--random-output-len", "16"]
    flags += ["--random-range-ratio", "0.5", "--max-concurrency", "3"]
    reports = {
        d: run_bench(server, tmp_path / f"{d}.jsonl", "--dataset", d, *flags)
        for d in ("random", "json-schema", "regex")
    }
    totals = {d: (r["total_input_tokens"], r["total_output_tokens_server"]) for d, r in reports.items()}
    assert len(set(totals.values())) == 1, totals
    assert reports["json-schema"]["constrained_invalid"] == 0 and reports["regex"]["constrained_invalid"] == 0


def test_tokenizer_route_matches_the_server_tokenization(server):
    from phloem.bench.bench_tokenizer import tokenizer_from_payload

    status, body = get(server + "/tokenizer")
    assert status == 200
    tok = tokenizer_from_payload(json.loads(body), server)
    text = "Count these: 1234 naïve <|im_end|> words."
    req = urllib.request.Request(
        server + "/v1/tokenize",
        data=json.dumps({"prompt": text, "add_special_tokens": False}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.loads(r.read())["tokens"] == tok.encode(text)


@pytest.mark.slow
def test_bench_serving_with_a_tokenizer_folder(server, tmp_path):
    """A Hugging Face tokenizer folder (what ``--tokenizer-path`` takes) works as ``--tokenizer``,
    and counts the same prompt tokens as the server's own tokenizer."""
    folder = tmp_path / "tok"
    export_tokenizer(folder)
    flags = [
        "--dataset",
        "random",
        "--num-prompts",
        "2",
        "--random-input-len",
        "24",
        "--random-output-len",
        "4",
    ]
    local = run_bench(server, tmp_path / "local.jsonl", *flags, "--tokenizer", str(folder))
    remote = run_bench(server, tmp_path / "remote.jsonl", *flags)
    assert local["tokenizer"] == str(folder) and remote["tokenizer"] == "server"
    assert local["total_input_tokens"] == remote["total_input_tokens"] == 2 * 24
    assert local["errors"] == [] and not local["token_count_mismatch"]


@pytest.mark.slow
def test_bench_serving_against_random_weights_and_a_tokenizer_folder(dummy_server, tmp_path):
    """``phloem serve --load-format dummy --tokenizer-path DIR`` (how GPU servers run): the bench
    takes the server's tokenizer without ``--tokenizer``; plain and constrained runs of the same
    lengths make the same tokens, every output obeys its grammar."""
    flags = ["--num-prompts", "3", "--random-input-len", "40", "--random-output-len", "48"]
    random_run = run_bench(dummy_server, tmp_path / "random.jsonl", "--dataset", "random", *flags)
    schema_run = run_bench(dummy_server, tmp_path / "schema.jsonl", "--dataset", "json-schema", *flags)
    for report in (random_run, schema_run):
        assert report["completed"] == 3 and report["errors"] == [] and report["tokenizer"] == "server"
        assert (report["total_input_tokens"], report["total_output_tokens_server"]) == (3 * 40, 3 * 48)
    assert random_run["token_count_check"] == "done"
    assert schema_run["constrained_invalid"] == 0
    assert schema_run["token_count_check"] == "not applicable: every output was constrained by a grammar"
