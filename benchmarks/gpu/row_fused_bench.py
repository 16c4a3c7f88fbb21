"""The few-row norm + projection kernels (``runtime/layers/row_fused.py``) against the separate
kernels they replace, with programmatic dependent launch (PDL) off and on, on a CUDA device.

For the qkv projection (residual add + RMSNorm, then the matmul) and the MLP's gate/up projection
(the same, then SiLU x mul) of SmolLM2-135M, Qwen3-0.6B and Llama-3-8B, at each row count of
``--rows`` (default one): device microseconds per layer step (a CUDA graph of many calls cycling over weight copies that exceed
L2, median replay, as in ``skinny_bench.py``) for

- ``separate``: ``add_rmsnorm`` + the projection the layer would otherwise run (``skinny_linear``
  where ``skinny_wins``, else ``F.linear``) (+ ``silu_and_mul``), three or two launches;
- ``fused``: ``norm_linear_rows``, one launch;

each with PDL off and on, and the floor (weight bytes / measured copy bandwidth). ``--sweep``
also times block sizes of the fused kernel (PDL off) and prints the fastest per shape.

Usage (repository root, on the GPU machine)::

    python3 -m benchmarks.gpu.row_fused_bench --out $OUT/row_fused_bench.json [--sweep] [--rows 1,2,5,16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from benchmarks.gpu.decode_bench import copy_bandwidth, run_record
from benchmarks.gpu.fused_bench import graph_us
from benchmarks.gpu.skinny_bench import DTYPE, SHAPES, cold_calls, cold_weights

PROJECTIONS = ("qkv", "gate_up")
SWEEP = {"block_n": [2, 4, 8, 16, 32], "block_k": [256, 512, 1024], "num_warps": [4, 8], "num_stages": [3]}
SWEEP_ROWS = {"block_n": [16, 32, 64], "block_k": [256, 1024], "num_warps": [4, 8], "num_stages": [3]}


class Step:
    """One norm + projection on the next weight copy, separate or fused."""

    def __init__(self, ws: list[torch.Tensor], glu: bool, fused: bool, config=None, rows: int = 1) -> None:  # noqa: ANN001
        k = ws[0].shape[1]
        self.ws, self.glu, self.fused, self.config, self.i = ws, glu, fused, config, 0
        self.x = torch.randn(rows, k, device="cuda").to(DTYPE)
        self.res = torch.randn(rows, k, device="cuda").to(DTYPE)
        self.g = (1 + 0.1 * torch.randn(k, device="cuda")).to(DTYPE)

    def __call__(self) -> torch.Tensor:
        import torch.nn.functional as F
        from phloem.runtime.layers import fused_triton
        from phloem.runtime.layers.row_fused import norm_linear_rows
        from phloem.runtime.layers.skinny_gemm import skinny_linear, skinny_wins

        self.i = (self.i + 1) % len(self.ws)
        w = self.ws[self.i]
        if self.fused:
            return norm_linear_rows(self.x, self.res, self.g, 1e-6, w, glu=self.glu, config=self.config)[0]
        normed, _ = fused_triton.add_rmsnorm(self.x, self.res, self.g, 1e-6)
        y = skinny_linear(normed, w) if skinny_wins(*w.shape, self.x.shape[0]) else F.linear(normed, w)
        return fused_triton.silu_and_mul(y) if self.glu else y


def _time(step: Step, ws: list[torch.Tensor], reps: int = 20) -> float:
    return graph_us(step, calls=cold_calls(ws), reps=reps)


def bench(bandwidth: float, do_sweep: bool, row_counts: list[int]) -> list[dict]:
    from phloem.runtime.layers.pdl import set_pdl
    from phloem.runtime.layers.skinny_gemm import SkinnyConfig

    rows = []
    for model, projections in SHAPES.items():
        for name in PROJECTIONS:
            n, k = projections[name]
            ws = cold_weights(n, k)
            glu = name == "gate_up"
            for m in row_counts:
                row: dict = {"model": model, "proj": name, "n": n, "k": k, "rows": m,
                         "floor_us": round(n * k * 2 / bandwidth * 1e6, 3)}  # fmt: skip
                for pdl in (False, True):
                    set_pdl(pdl)
                    tag = "pdl" if pdl else "plain"
                    row[f"separate_{tag}_us"] = round(_time(Step(ws, glu, False, rows=m), ws), 3)
                    row[f"fused_{tag}_us"] = round(_time(Step(ws, glu, True, rows=m), ws), 3)
                if do_sweep and (m == 1 or n * k <= 1 << 24):  # 2-16 rows: the shapes routed to fusion
                    set_pdl(False)
                    timed = []
                    for bn, bk, nw, ns in itertools.product(*(SWEEP if m == 1 else SWEEP_ROWS).values()):
                        if bk > 2 * k:
                            continue
                        cfg = SkinnyConfig(bn, bk, nw, ns)
                        try:
                            timed.append((_time(Step(ws, glu, True, cfg, rows=m), ws, reps=10), cfg))
                        except Exception as exc:  # out of registers or shared memory for this tile
                            print(f"skip {cfg}: {type(exc).__name__}", flush=True)
                    timed.sort(key=lambda t: t[0])
                    row["best"] = [{"us": round(us, 3), **c._asdict()} for us, c in timed[:5]]
                set_pdl(True)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweep", action="store_true", help="also time block sizes of the fused kernel")
    ap.add_argument("--rows", default="1", help="comma-separated row counts (1-16)")
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    with torch.inference_mode():
        rows = bench(bandwidth, args.sweep, [int(r) for r in args.rows.split(",")])
    report = {**run_record("row_fused_bench", DTYPE, bandwidth), "floor": "weight bytes / copy bandwidth",
              "rows": rows}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(
        f"\n{'model':13} {'proj':8} {'rows':>4} {'floor':>7} {'sep':>7} {'fused':>7} {'sep+pdl':>8} {'fused+pdl':>9}"
    )
    for r in rows:
        print(f"{r['model']:13} {r['proj']:8} {r['rows']:>4} {r['floor_us']:>7.2f} {r['separate_plain_us']:>7.2f} "
              f"{r['fused_plain_us']:>7.2f} {r['separate_pdl_us']:>8.2f} {r['fused_pdl_us']:>9.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
