"""The tensor-parallel decode cost model: weight bytes by hand, and how the terms move."""

from __future__ import annotations

from phloem.bench.tp_cost_model import decode_weight_bytes, main, predict
from phloem.runtime.models.config import ModelConfig


def test_decode_weight_bytes_by_hand() -> None:
    cfg = ModelConfig.dummy("tiny-llama")  # hidden 64, inter 128, 2 layers, 4 q / 2 kv heads of 16, vocab 512
    layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert decode_weight_bytes(cfg) == (2 * layer + 64 + 512 * 64) * 2


def test_one_rank_has_no_collectives_and_the_measured_efficiency() -> None:
    cfg = ModelConfig.dummy("llama3-8b")
    (one,) = predict(cfg, batch=1, tp_sizes=[1], efficiency=0.8)
    assert one.collective_ms == 0 and one.speedup == 1.0
    assert abs(one.floor_fraction - 0.8) < 1e-9


def test_latency_bounds_the_speedup() -> None:
    cfg = ModelConfig.dummy("llama3-8b")
    fast = predict(cfg, batch=1, tp_sizes=[1, 2, 8], efficiency=0.8, latency_us=1.0)
    slow = predict(cfg, batch=1, tp_sizes=[1, 2, 8], efficiency=0.8, latency_us=50.0)
    assert fast[1].speedup > slow[1].speedup and fast[2].speedup > fast[1].speedup
    assert fast[2].speedup < 8  # collectives never vanish
    assert slow[2].collective_ms > slow[2].weight_ms  # 65 latency-bound all-reduces dominate


def test_cli_prints_a_row_per_size(capsys) -> None:
    assert main(["--dummy-shape", "llama3-70b", "--tp", "4,8", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert [r["tp"] for r in out["rows"]] == [4, 8]
