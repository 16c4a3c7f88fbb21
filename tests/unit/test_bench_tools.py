"""Small pure pieces of the benchmark scripts: scaling, padding, timing maths, ratio tables."""

from __future__ import annotations

import pytest
from phloem.bench.client import Result
from phloem.bench.compare import ratio_table
from phloem.bench.one_batch import batch_timing
from phloem.bench.radix_shared_prefix import Workload, left_pad


def test_full_workload_is_the_documented_one():
    w = Workload()
    assert (w.num_requests, w.prefix_len, w.question_len, w.output_len, w.in_flight) == (64, 1024, 32, 64, 8)
    opt = w.dataset_options()
    assert (opt.num_groups, opt.prompts_per_group, opt.prefix_len) == (4, 16, 1024)


def test_scaled_workload_shrinks_and_keeps_floors():
    w = Workload.scaled(0.25)
    assert (w.num_requests, w.prefix_len, w.output_len, w.question_len, w.in_flight) == (16, 256, 16, 32, 8)
    tiny = Workload.scaled(0.01)
    assert (tiny.prompts_per_group, tiny.prefix_len, tiny.output_len) == (2, 64, 8)


def test_left_pad():
    ids, mask = left_pad([[1, 2, 3], [4]], pad=0)
    assert ids == [[1, 2, 3], [0, 0, 4]] and mask == [[1, 1, 1], [0, 0, 1]]


def test_batch_timing():
    rs = []
    for ttft, latency in [(0.5, 2.0), (1.0, 2.5)]:
        r = Result(0, 0, 10, 4, success=True)
        r.ttft, r.latency = ttft, latency
        rs.append(r)
    row = batch_timing(rs, batch=2, input_len=10, output_len=4)
    assert row["prefill_s"] == 1.0 and row["prefill_tok_s"] == 20.0
    assert row["decode_step_ms"] == pytest.approx(500.0) and row["decode_tok_s"] == pytest.approx(4.0)


def test_ratio_table_uses_medians():
    def rep(tput: float) -> dict:
        return {"output_throughput": tput, "mean_ttft_ms": 100.0, "failed": 0, "cache_hit_rate": None}

    text, ratios = ratio_table({"phloem": [rep(10), rep(30), rep(20)], "hf": [rep(5), rep(5)]}, "hf")
    assert ratios["output_throughput"]["ratio"] == 4.0
    assert ratios["mean_ttft_ms"]["ratio"] == 1.0 and ratios["cache_hit_rate"]["ratio"] is None
    assert "output tok/s" in text and "failed requests" in text
