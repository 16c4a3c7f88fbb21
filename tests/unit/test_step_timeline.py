"""``benchmarks/step_timeline.py``: phases and per-batch decode figures from scheduler log lines."""

from __future__ import annotations

import pytest
from phloem.bench.step_timeline import parse, timeline


def _line(ms: int, kind: str, count: int, tokens: int) -> str:
    stamp = f"2026-11-30 10:00:{ms // 1000:02d},{ms % 1000:03d}"
    if kind == "Prefill":
        return (f"[{stamp} scheduler] Prefill batch. #new-seq: {count}, #new-token: {tokens}, "
                "#cached-token: 0, token usage: 0.00, #running-req: 1, #queue-req: 0")  # fmt: skip
    return (f"[{stamp} scheduler] Decode batch. #running-req: {count}, #token: {tokens}, token usage: 0.01, "
            "gen throughput (token/s): 1.00, #queue-req: 0")  # fmt: skip


def test_phases_bins_and_gaps() -> None:
    lines = [
        _line(0, "Prefill", 1, 16),  # the benchmark's warm-up request: not part of the run
        _line(5, "Decode", 1, 17),
        "unrelated output",
        _line(100, "Prefill", 40, 8192),
        _line(140, "Decode", 40, 8300),  # interleaved with the prefill: prefill phase
        _line(200, "Prefill", 30, 6000),
        _line(210, "Decode", 70, 14000),  # 70 rows: bin 64-95, 10 ms then 10 ms
        _line(220, "Decode", 70, 14070),
        _line(230, "Decode", 33, 6600),  # bin 32-63: 50 ms
        _line(280, "Decode", 33, 6633),
    ]
    events = parse(lines)
    assert len(events) == 9
    out = timeline(events)
    assert out["prefill_seconds"] == pytest.approx(0.1)
    assert out["prefill_passes"] == 2
    assert out["decode_steps"] == 4
    assert out["decode_seconds"] == pytest.approx(0.07)
    by = {r["batch"]: r for r in out["decode_by_batch"]}
    assert by["64-95"]["steps"] == 2 and by["64-95"]["ms_per_step"] == pytest.approx(10.0)
    assert by["64-95"]["mean_context"] == round((14000 + 14070) / 140)
    assert by["64-95"]["tok_s"] == 7000  # 140 rows in 0.02 s
    assert by["32-63"]["steps"] == 1 and by["32-63"]["ms_per_step"] == pytest.approx(50.0)
    assert out["slowest_gaps"][0] == {"ms": 60.0, "after": "Decode", "count": 40}


def test_needs_per_step_logging() -> None:
    with pytest.raises(ValueError, match="log-interval"):
        timeline(parse([_line(0, "Prefill", 1, 16), _line(5, "Decode", 1, 17)]))


def test_continuous_decode_lines_count_their_steps() -> None:
    """A line with ``#steps: K`` reports a launch of K steps; the gap ending at it is that launch."""
    lines = [
        _line(0, "Prefill", 1, 16),
        _line(10, "Prefill", 64, 8192),
        _line(20, "Prefill", 64, 8192),
        _line(30, "Decode", 64, 8300),
        _line(70, "Decode", 64, 8812) + ", #steps: 8",  # 8 steps in 40 ms
        _line(110, "Decode", 64, 9324) + ", #steps: 8",
    ]
    out = timeline(parse(lines))
    assert out["decode_steps"] == 17
    by = {r["batch"]: r for r in out["decode_by_batch"]}
    assert by["64-95"]["steps"] == 16
    assert by["64-95"]["ms_per_step"] == pytest.approx(5.0)
    assert by["64-95"]["tok_s"] == 12800  # 64 rows x 16 steps in 0.08 s
    assert by["64-95"]["mean_context"] == round((8300 + 8812) / 128)
