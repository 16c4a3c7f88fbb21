"""cuBLAS on the decode step's projection shapes: time, TFLOP/s and bandwidth per call.

    python3 benchmarks/gpu/gemm_shapes.py --shape llama3-8b --rows 64,128,208,256 --out $OUT/gemm.json

For each projection of one layer (qkv, o, gate/up, down) and the LM head, at each row count:
``F.linear`` in the model's dtype, and for the LM head also the float32-output paths
(``F.linear(...).float()`` against ``torch.mm(..., out_dtype=torch.float32)``). Times are medians
of CUDA-event timings over back-to-back calls; the floors are the weight bytes at the measured
copy bandwidth and the FLOPs at the measured large-GEMM rate (both passed in, defaults from
``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def time_call(fn: Callable[[], Any], reps: int = 50) -> float:
    """Median microseconds per call (CUDA events around each call after a warm-up)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """``name -> (out_features, in_features)`` of one layer and the LM head."""
    from phloem.runtime.models.config import ModelConfig

    c = ModelConfig.dummy(shape)
    hd = c.head_dim
    return {
        "qkv": ((c.num_heads + 2 * c.num_kv_heads) * hd, c.hidden_size),
        "o": (c.hidden_size, c.num_heads * hd),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "lm_head": (c.vocab_size, c.hidden_size),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--rows", default="64,128,208,256")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bandwidth-tbs", type=float, default=4.3)
    p.add_argument("--tflops", type=float, default=790.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for name, (n, k) in projections(args.shape).items():
        w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            floor_us = max(
                n * k * w.element_size() / (args.bandwidth_tbs * 1e6), 2 * m * n * k / (args.tflops * 1e6)
            )
            paths: dict[str, Callable[[], Any]] = {"linear": lambda x=x, w=w: F.linear(x, w)}
            if name == "lm_head":
                paths["linear_float"] = lambda x=x, w=w: F.linear(x, w).float()
                paths["mm_out_f32"] = lambda x=x, w=w: torch.mm(x, w.t(), out_dtype=torch.float32)
            for path, fn in paths.items():
                try:
                    us = time_call(fn)
                except (RuntimeError, TypeError) as e:  # out_dtype missing in this torch
                    results.append({"proj": name, "rows": m, "path": path, "error": str(e)[:200]})
                    continue
                row = {
                    "proj": name,
                    "rows": m,
                    "path": path,
                    "n": n,
                    "k": k,
                    "us": round(us, 2),
                    "tflops": round(2 * m * n * k / us / 1e6, 1),
                    "floor_us": round(floor_us, 2),
                    "ratio": round(us / floor_us, 2),
                }
                results.append(row)
                print(
                    f"{name:8s} rows {m:4d} {path:13s} {us:8.1f} us  {row['tflops']:6.1f} TFLOP/s  "
                    f"floor {floor_us:7.1f} us  {row['ratio']:.2f}x",
                    flush=True,
                )
    with open(args.out, "w") as f:
        json.dump(
            {
                "command": " ".join(__import__("sys").argv),
                "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "results": results,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
