"""benchmarks/gpu/trace_gaps.py on a hand-made trace: gaps, their launches, the host frames."""

from __future__ import annotations

import gzip
import json

from phloem.bench.gpu.trace_gaps import analyse


def _x(cat, name, ts, dur, tid=1, **args):  # noqa: ANN001, ANN202
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_a_late_launch_is_charged_to_the_frame_the_host_was_in(tmp_path):
    events = [
        # worker thread: launches k1 at 1, sits in admission code from 20 to 390, launches k2 at 400
        _x("python_function", "runtime/executor/worker.py(98): _run", 0, 500),
        _x("python_function", "runtime/scheduler/scheduler.py(256): _try_admit", 20, 370),
        _x("python_function", "torch/nn/modules/module.py(1): _call_impl", 30, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 1, 3, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 400, 3, correlation=2),
        _x("cuda_runtime", "cudaLaunchKernel", 404, 3, correlation=3),
        _x("kernel", "k1", 10, 90, tid=7, correlation=1),  # GPU busy 10..100
        _x("kernel", "k2", 410, 50, tid=7, correlation=2),  # idle 100..410: waited for the launch
        _x("kernel", "k3", 470, 10, tid=7, correlation=3),  # idle 460..470: under the threshold
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    res = analyse(str(path), min_gap=50.0, top=5)
    assert res["gaps"] == 1 and res["gap_us_total"] == 310.0
    row = res["largest"][0]
    assert row["next"] == "k2" and row["late_us"] == 300.0
    assert row["at_gap"] == [
        "runtime/executor/worker.py(98): _run",
        "runtime/scheduler/scheduler.py(256): _try_admit",
    ]
    assert row["at_launch"] == ["runtime/executor/worker.py(98): _run"]
    assert res["by_frame"] == [("runtime/scheduler/scheduler.py(256): _try_admit", 310.0, 1)]
