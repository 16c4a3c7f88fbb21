"""The rows matmul kernel (``runtime/layers/rows_gemm.py``) against cuBLAS and cuBLASLt per row count.

    python3 -m benchmarks.gpu.rows_gemm_bench --shape llama3-8b --rows 64,128,208,256 --out $OUT/rows.json

For every projection of one layer and every row count, times cuBLAS (``F.linear``), cuBLASLt and
the rows kernel at each setting of a small grid (column block, key block, warps, stages) x a few
key splits chosen to fill the GPU in one or two waves. One call's time comes from a CUDA graph of
``--reps`` calls that cycle through copies of the weight totalling at least ``--min-bytes``, so
the weights come from HBM as in a decode step (one copy of a 34 MB projection would stay in L2).
Each result of the kernel is checked against ``F.linear`` before it is timed.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton

from benchmarks.gpu.gemm_rows import graph_time_us, parse_rows

# (block_n, block_k, num_warps, num_stages)
TILES = [(64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 4), (128, 64, 4, 4), (128, 128, 8, 3)]


def split_choices(n: int, k: int, block_n: int, block_k: int, sms: int) -> list[int]:
    """Key splits that put about one or two waves of programs on ``sms`` SMs, and no split."""
    tiles = triton.cdiv(n, block_n)
    blocks = triton.cdiv(k, block_k)
    out = {1}
    for waves in (1, 2):
        s = max(1, round(waves * sms / tiles))
        out.add(min(s, 16, blocks))
    return sorted(out)


def cycling(fn: Callable[[torch.Tensor], Any], weights: list[torch.Tensor]) -> Callable[[], Any]:
    """``fn`` on the next copy of the weight at every call (round robin)."""
    calls = itertools.count()
    return lambda: fn(weights[next(calls) % len(weights)])


def main() -> int:
    from phloem.runtime.layers.rows_gemm import RowsConfig, rows_linear

    from benchmarks.gpu.gemm_shapes import projections

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--rows", default="64,128,208,256")
    p.add_argument("--projections", default="qkv,o,gate_up,down")
    p.add_argument("--reps", type=int, default=24)
    p.add_argument("--min-bytes", type=float, default=256e6)
    p.add_argument("--bandwidth-tbs", type=float, default=4.3)
    p.add_argument("--tflops", type=float, default=790.0)
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="only compile every setting (fills Triton's cache; run several at once)",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dtype = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results: list[dict[str, Any]] = []
    for name, (n, k) in projections(args.shape).items():
        if name not in args.projections.split(","):
            continue
        copies = max(1, int(-(-args.min_bytes // (n * k * 2))))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5 for _ in range(copies)]
        for m in parse_rows(args.rows):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            if args.compile_only:
                for bn, bk, warps, stages in TILES:
                    for split in split_choices(n, k, bn, bk, sms):
                        try:
                            rows_linear(x, weights[0], config=RowsConfig(bn, bk, split, warps, stages))
                        except Exception as exc:
                            print(
                                f"compile {name} {m} {(bn, bk, split, warps, stages)}: {type(exc).__name__}"
                            )
                continue
            ref = F.linear(x.float(), weights[0].float())
            floor = max(n * k * 2 / (args.bandwidth_tbs * 1e6), 2 * m * n * k / (args.tflops * 1e6))
            row: dict[str, Any] = {"shape": args.shape, "projection": name, "n": n, "k": k, "rows": m,
                                   "floor_us": round(floor, 2), "weight_copies": copies}  # fmt: skip
            cycle = functools.partial(cycling, weights=weights)
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                row[f"{lib}_us"] = round(graph_time_us(cycle(lambda w, x=x: F.linear(x, w)), args.reps), 2)
            torch.backends.cuda.preferred_blas_library("cublas")
            tried = []
            for bn, bk, warps, stages in TILES:
                for split in split_choices(n, k, bn, bk, sms):
                    cfg = RowsConfig(bn, bk, split, warps, stages)
                    try:
                        got = rows_linear(x, weights[0], config=cfg).float()
                        err = ((got - ref).norm() / ref.norm()).item()
                        if err > 1e-2:
                            tried.append({"cfg": list(cfg), "error": f"rel err {err:.2e}"})
                            continue
                        t = graph_time_us(
                            cycle(lambda w, x=x, cfg=cfg: rows_linear(x, w, config=cfg)), args.reps
                        )
                    except Exception as exc:  # a tile the compiler rejects (shared memory, registers)
                        tried.append({"cfg": list(cfg), "error": type(exc).__name__})
                        continue
                    tried.append({"cfg": list(cfg), "us": round(t, 2), "rel_err": err})
            ok = [t for t in tried if "us" in t]
            row["rows_kernel"] = tried
            if ok:
                best = min(ok, key=lambda t: t["us"])
                row["rows_us"], row["rows_cfg"] = best["us"], best["cfg"]
                lib_best = min(row["cublas_us"], row["cublaslt_us"])
                row["speedup_vs_best_lib"] = round(lib_best / best["us"], 3)
            results.append(row)
            print(f"{name:8} N={n:6} K={k:6} rows={m:4}  cublas {row['cublas_us']:7.2f}  lt {row['cublaslt_us']:7.2f}"
                  f"  rows {row.get('rows_us', float('nan')):7.2f} {row.get('rows_cfg')}  floor {floor:6.2f}",
                  flush=True)  # fmt: skip
    if args.compile_only:
        torch.cuda.synchronize()
        return 0
    with open(args.out, "w") as f:
        json.dump({"benchmark": "rows_gemm_bench", "command": "python3 -m benchmarks.gpu.rows_gemm_bench "
                   + " ".join(sys.argv[1:]), "git_commit": os.environ.get("GIT_COMMIT", "unknown"),
                   "device": torch.cuda.get_device_name(), "results": results}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
