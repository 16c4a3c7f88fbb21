"""benchmarks/gpu/window_phases.py on a hand-made trace: windows split at idle gaps, each step cut
into draft, verify and rest at the target's layers."""

from __future__ import annotations

import gzip
import json

from phloem.bench.gpu.window_phases import kernels, phases, windows

DRAFT = ["embed", "proj", "attend"]
LAYER = [
    "_norm_rows_kernel",
    "_rope_store_kernel",
    "_tree_verify_kernel",
    "_skinny_kernel",
    "_norm_rows_kernel",
    "_skinny_kernel",
]
REST = ["_rmsnorm_kernel", "lm_head", "argmax", "catch_up"]


def _trace(tmp_path, windows_: int = 2, steps: int = 4):  # noqa: ANN001, ANN202
    events, ts = [], 0.0
    for _ in range(windows_):
        for _ in range(steps):
            for name in [*DRAFT, *LAYER, *LAYER, *REST]:  # a two-layer target
                events.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": 1.0})
                ts += 2.0
        ts += 1000.0  # the host reads the window's tokens
    path = tmp_path / "w.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def test_steps_are_cut_at_the_target_s_layers(tmp_path):
    wins = windows(kernels(_trace(tmp_path)))
    assert len(wins) == 2 and all(len(w) == 4 * (3 + 12 + 4) for w in wins)
    rows = phases(wins[0])
    assert len(rows) == 2  # the first and last step of a window are left out
    for r in rows:
        # every kernel is 2 us apart: draft 3 kernels, verify 2 layers of 6, rest 4
        assert (r["draft_kernels"], r["verify_kernels"], r["rest_kernels"]) == (3, 12, 4)
        assert (r["draft_us"], r["verify_us"], r["rest_us"], r["step_us"]) == (6.0, 24.0, 8.0, 38.0)
