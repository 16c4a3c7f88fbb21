"""``phloem bench offline`` end to end on the CPU: a small random dataset through an in-process
Engine on the default model. Every output token is counted, the client's retokenized count agrees
with the server's (real weights: the token check applies), and the JSON line carries the report."""

from __future__ import annotations

import json

from phloem.bench import cli


def test_offline_bench_counts_every_token(tmp_path) -> None:
    out = tmp_path / "offline.jsonl"
    argv = ["offline", "--device", "cpu", "--dataset", "random", "--num-prompts", "4", "--random-input-len", "24",
            "--random-output-len", "6", "--seed", "0", "--disable-tqdm", "--output-file", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    report = json.loads(out.read_text().splitlines()[-1])
    assert report["backend"] == "engine" and report["completed"] == 4 and report["failed"] == 0
    assert report["total_output_tokens"] == report["total_output_tokens_server"] == 4 * 6  # ignore_eos
    assert report["token_count_check"] == "done" and not report["token_count_mismatch"]
    assert report["errors"] == [] and report["output_throughput"] > 0 and report["mean_ttft_ms"] > 0
