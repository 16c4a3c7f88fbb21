"""Projection GEMMs against their row count: cuBLAS, cuBLASLt and Triton tiles, back to back.

    python3 benchmarks/gpu/gemm_rows.py --shape llama3-8b --rows 8:256:8 --out $OUT/rows.json

Decode runs each projection at the batch's row count M. How long a GEMM takes is not monotone in
M: the library picks a tile per M, and a tile that fits 256 rows may beat the one it picks for 208.
This script times every projection of one layer at every M of a grid, with the time of one call
taken from a CUDA graph of ``--reps`` back-to-back calls (no launch gaps, as inside the decode
graph). Paths:

- ``cublas``: ``F.linear`` with torch's default BLAS library;
- ``cublaslt``: the same after ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
- ``triton``: a tensor-descriptor (TMA) Triton GEMM, the best of ``TRITON_CONFIGS`` per M.

For each M it also prints the *padded envelope*: the fastest cuBLAS time over row counts
``M' >= M`` of the grid, i.e. what running the GEMM on M' rows (the spare rows ignored) would
cost.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)
TRITON_CONFIGS = [
    (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 256, 64, 3, 4),
    (128, 64, 64, 4, 4),
    (128, 64, 128, 3, 8),
    (128, 128, 64, 4, 8),
    (128, 256, 64, 3, 8),
    (256, 64, 64, 3, 8),
    (256, 128, 64, 3, 8),
]


@triton.jit
def _tma_mm_kernel(a_desc, w_desc, c_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    # c[M, N] = a[M, K] @ w[N, K].T; the row tiles of one weight tile run next to each other
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % tiles_m
    pid_n = pid // tiles_m
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        a = a_desc.load([pid_m * BLOCK_M, k])
        w = w_desc.load([pid_n * BLOCK_N, k])
        acc = tl.dot(a, w.T, acc)
    c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


def triton_linear(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int, int, int, int]) -> Callable[[], Any]:
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, stages, warps = cfg
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    a_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)

    def run() -> torch.Tensor:
        _tma_mm_kernel[grid](a_desc, w_desc, c_desc, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             NUM_STAGES=stages, num_warps=warps)  # fmt: skip
        return out

    return run


def graph_time_us(fn: Callable[[], Any], reps: int, replays: int = 5) -> float:
    """Microseconds per call: a CUDA graph of ``reps`` calls, replayed, median replay / reps."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    times.sort()
    return times[len(times) // 2]


def parse_rows(spec: str) -> list[int]:
    """``"8:256:8"`` (start:stop:step, stop included) or ``"64,128,208"``."""
    if ":" in spec:
        start, stop, step = (int(v) for v in spec.split(":"))
        return list(range(start, stop + 1, step))
    return [int(r) for r in spec.split(",")]


def padded_envelope(times: dict[int, float]) -> dict[int, tuple[int, float]]:
    """For each M, the row count ``M' >= M`` of the grid with the least time, and that time."""
    best: dict[int, tuple[int, float]] = {}
    running: tuple[int, float] | None = None
    for m in sorted(times, reverse=True):
        if running is None or times[m] <= running[1]:
            running = (m, times[m])
        best[m] = running
    return best


def main() -> None:
    from benchmarks.gpu.gemm_shapes import projections

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--rows", default="8:256:8")
    p.add_argument("--paths", default="cublas,cublaslt,triton")
    p.add_argument("--projections", default="qkv,o,gate_up,down")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--bandwidth-tbs", type=float, default=4.3)
    p.add_argument("--tflops", type=float, default=790.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dtype = torch.bfloat16
    rows = parse_rows(args.rows)
    paths = args.paths.split(",")
    wanted = args.projections.split(",")
    results: list[dict[str, Any]] = []
    for name, (n, k) in projections(args.shape).items():
        if name not in wanted:
            continue
        w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
        per_path: dict[str, dict[int, float]] = {path: {} for path in paths}
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            floor = max(n * k * 2 / (args.bandwidth_tbs * 1e6), 2 * m * n * k / (args.tflops * 1e6))
            row: dict[str, Any] = {"projection": name, "n": n, "k": k, "rows": m, "floor_us": floor}
            for path in paths:
                if path == "triton":
                    best = None
                    for cfg in TRITON_CONFIGS:
                        try:
                            t = graph_time_us(triton_linear(x, w, cfg), args.reps)
                        except Exception as exc:  # a config the compiler rejects: skip it
                            row.setdefault("triton_errors", []).append(f"{cfg}: {type(exc).__name__}")
                            continue
                        if best is None or t < best[0]:
                            best = (t, cfg)
                    if best is not None:
                        row["triton_us"], row["triton_cfg"] = best[0], list(best[1])
                        got = triton_linear(x, w, best[1])().float()
                        row["triton_max_err"] = (got - F.linear(x, w).float()).abs().max().item()
                        per_path[path][m] = best[0]
                    continue
                lib = "cublaslt" if path == "cublaslt" else "cublas"
                torch.backends.cuda.preferred_blas_library(lib)
                t = graph_time_us(lambda x=x, w=w: F.linear(x, w), args.reps)
                torch.backends.cuda.preferred_blas_library("cublas")
                row[f"{path}_us"] = t
                per_path[path][m] = t
            results.append(row)
        env = padded_envelope(per_path["cublas"]) if per_path.get("cublas") else {}
        print(f"\n{args.shape} {name}: N={n} K={k}  (us per call; pad = best cuBLAS over M' >= M)")
        print("  rows " + "".join(f"{p:>10}" for p in paths) + "  triton cfg         pad to    pad us  floor")
        for r in results:
            if r["projection"] != name:
                continue
            m = r["rows"]
            cells = "".join(f"{r.get(f'{p}_us', float('nan')):10.1f}" for p in paths)
            cfg = str(tuple(r["triton_cfg"])) if "triton_cfg" in r else ""
            pad_m, pad_t = env.get(m, (m, float("nan")))
            r["pad_rows"], r["pad_us"] = pad_m, pad_t
            print(f"  {m:4d} {cells}  {cfg:18s} {pad_m:6d} {pad_t:9.1f} {r['floor_us']:6.1f}")
    with open(args.out, "w") as f:
        json.dump({"shape": args.shape, "reps": args.reps, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
