"""The skinny matmul kernel (``runtime/layers/skinny_gemm.py``) against ``F.linear`` at decode
row counts, on a CUDA device.

For every projection of SmolLM2-135M, Qwen3-0.6B and Llama-3-8B (``[N, K]`` weights, bfloat16)
and 1, 4, 8, 16 rows (``--rows``): device microseconds per call (a CUDA graph of 50 calls, median replay, as
in a captured decode step; the calls cycle over copies of the weight that together exceed L2 five
times, so each reads its weight from HBM as in a real step), the floor (weight + input + output bytes / measured copy bandwidth),
and the kernel's relative error against ``F.linear``. ``--sweep`` also times a grid of block
sizes at 1 and 8 rows and prints the fastest per shape (how :func:`pick_config` was chosen).

Usage (repository root, on the GPU machine)::

    python3 -m benchmarks.gpu.skinny_bench --out $OUT/skinny_bench.json [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from benchmarks.gpu.decode_bench import copy_bandwidth, run_record
from benchmarks.gpu.fused_bench import graph_us

SHAPES = {  # model -> projection -> (N, K)
    "smollm2-135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                     "lm_head": (49152, 576)},
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                   "lm_head": (151936, 1024)},
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                  "lm_head": (128256, 4096)},
}  # fmt: skip
ROWS = [1, 4, 8, 16]
DTYPE = torch.bfloat16
SWEEP = {
    "block_n": [4, 8, 16, 32, 64],
    "block_k": [128, 256, 512, 1024],
    "num_warps": [4, 8],
    "num_stages": [3],  # 2-4 moved results by under 2% in a first sweep
}


COLD_BYTES = 256 << 20  # weight copies cycled per timed call: 5x the H200's 50 MB L2


def cold_weights(n: int, k: int) -> list[torch.Tensor]:
    """Copies of one random ``[n, k]`` weight, enough that each call of a timed graph reads its
    weight from HBM, as a decode step does (the model's weights do not fit in L2)."""
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(DTYPE)
    copies = max(1, -(-COLD_BYTES // w.nbytes))
    return [w] + [w.clone() for _ in range(copies - 1)]


def cold_calls(weights: list[torch.Tensor]) -> int:
    """Calls per timed graph: every copy once (at most 400), so the graph's replays cannot find
    the weights in L2 from the previous replay."""
    return min(400, max(50, len(weights)))


class Cycle:
    """``fn(x, w)`` over the weights in turn: each call (and each captured call) reads the next."""

    def __init__(self, fn, x: torch.Tensor, weights: list[torch.Tensor]) -> None:  # noqa: ANN001
        self.fn, self.x, self.weights, self.i = fn, x, weights, 0

    def __call__(self) -> torch.Tensor:
        self.i = (self.i + 1) % len(self.weights)
        return self.fn(self.x, self.weights[self.i])


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def bench_shapes(bandwidth: float, rows: list[int] = ROWS) -> list[dict]:
    from phloem.runtime.layers.skinny_gemm import pick_config, skinny_linear

    rows_out = []
    for model, projections in SHAPES.items():
        for name, (n, k) in projections.items():
            ws = cold_weights(n, k)
            w = ws[0]
            for m in rows:
                x = torch.randn(m, k, device="cuda").to(DTYPE)
                ref = F.linear(x, w)
                out = skinny_linear(x, w)
                floor_us = (n * k + m * k + m * n) * 2 / bandwidth * 1e6
                lib = graph_us(Cycle(F.linear, x, ws), calls=cold_calls(ws))
                ours = graph_us(Cycle(skinny_linear, x, ws), calls=cold_calls(ws))
                row = {"model": model, "proj": name, "n": n, "k": k, "rows": m,
                       "config": pick_config(n, k, m)._asdict(), "floor_us": round(floor_us, 3),
                       "linear_us": round(lib, 3), "skinny_us": round(ours, 3),
                       "speedup": round(lib / ours, 3), "rel_err": _rel(out, ref)}  # fmt: skip
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    return rows_out


def sweep(bandwidth: float) -> list[dict]:
    """Fastest block sizes per (shape, rows) over :data:`SWEEP` (invalid combinations skipped)."""
    from phloem.runtime.layers.skinny_gemm import SkinnyConfig, skinny_linear

    best_rows = []
    for model, projections in SHAPES.items():
        for name, (n, k) in projections.items():
            if name == "lm_head" and n * k > 10**8:
                continue  # a sweep over the large heads takes minutes
            ws = cold_weights(n, k)
            w = ws[0]
            for m in (1, 8):
                x = torch.randn(m, k, device="cuda").to(DTYPE)
                ref = F.linear(x, w)
                timed = []
                for bn, bk, nw, ns in itertools.product(*SWEEP.values()):
                    if (m > 1 and bn < 16) or bk > 2 * k:
                        continue  # tl.dot needs 16+ columns; a chunk past twice K is waste
                    cfg = SkinnyConfig(bn, bk, nw, ns)
                    try:
                        if _rel(skinny_linear(x, w, config=cfg), ref) > 2e-2:
                            continue
                        call = Cycle(lambda xx, ww: skinny_linear(xx, ww, config=cfg), x, ws)  # noqa: B023
                        us = graph_us(call, calls=cold_calls(ws), reps=10)
                        timed.append((us, cfg))
                    except Exception as exc:  # out of shared memory or registers for this tile
                        print(f"skip {cfg}: {type(exc).__name__}", flush=True)
                timed.sort(key=lambda t: t[0])
                row = {"model": model, "proj": name, "n": n, "k": k, "rows": m,
                       "best": [{"us": round(us, 3), **c._asdict()} for us, c in timed[:5]]}  # fmt: skip
                best_rows.append(row)
                print(json.dumps(row), flush=True)
    return best_rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweep", action="store_true", help="also time a grid of block sizes")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts (1-16)")
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    with torch.inference_mode():
        shapes = bench_shapes(bandwidth, [int(r) for r in args.rows.split(",")])
        best = sweep(bandwidth) if args.sweep else []
    report = {
        **run_record("skinny_bench", DTYPE, bandwidth),
        "floor": "(weight + input + output bytes) / copy bandwidth",
        "shapes": shapes,
        "sweep": best,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{'model':13} {'proj':8} {'rows':>4} {'floor us':>8} {'linear us':>9} {'skinny us':>9} {'x':>5}")
    for r in shapes:
        print(f"{r['model']:13} {r['proj']:8} {r['rows']:>4} {r['floor_us']:>8.2f} {r['linear_us']:>9.2f} "
              f"{r['skinny_us']:>9.2f} {r['speedup']:>5.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
