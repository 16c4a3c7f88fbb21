"""Fused layer kernels on a CUDA device: each kernel against its torch reference, then the whole
decode step with the kernels on and off (DESIGN.md §11).

Kernels (``runtime/layers/fused_triton.py``) at decode-like row counts ``T`` (1, 64, 256) for
hidden 576 (SmolLM2-135M: MLP width 1536, 9 q / 3 kv heads of 64) and 4096 (Llama-3-8B: 14336,
32 / 8 heads of 128), bfloat16. The torch side is the code the CPU runs (``*_ref`` next to each
layer); its kernel count per call is in ``torch_kernels``:

    add_rmsnorm   residual = x + residual; rmsnorm(residual)       bytes = (4 T H + H) e
    rmsnorm       rmsnorm(x)                                         bytes = (2 T H + H) e
    silu_and_mul  silu(gate) * up on [T, 2I]                         bytes = 3 T I e
    rope          q, k of one fused qkv row, in place (ref: copies)  bytes = 2 T (Hq + Hk) D e + 4 T D

For each: ``graph_us``, device time per call (a CUDA graph of ``CALLS`` calls, median of its
replays: no launch gaps, as in a captured decode step); ``eager_us``, time per call of ``CALLS``
back-to-back eager calls (host launch cost included, as in an eager step); floor = bytes / copy
bandwidth; and the fused output's relative error against the reference on the same inputs.

Step: ``benchmarks.gpu.decode_bench.bench_model`` with the triton attention backend and the
fused kernels off, then on (graphs recaptured for each), context 1024, greedy.

Usage (in the repository root, on the GPU machine)::

    python3 -m benchmarks.gpu.fused_bench --out $OUT/fused_bench.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch

from benchmarks.gpu.decode_bench import _fast_dummy_weights, bench_model, copy_bandwidth, run_record

SHAPES = {  # name -> hidden, MLP width, q heads, kv heads, head dim
    "h576": (576, 1536, 9, 3, 64),
    "h4096": (4096, 14336, 32, 8, 128),
}
ROWS = [1, 64, 256]
CALLS = 50  # calls per timed graph / eager burst
DTYPE = torch.bfloat16
# kernels one reference call launches in bf16, counted from the code: rmsnorm = float, pow, mean,
# + eps, rsqrt, mul, weight float, mul, cast; rope = per tensor float, 4 mul, sub, add, cat, cast
TORCH_KERNELS = {"add_rmsnorm": 10, "rmsnorm": 9, "silu_and_mul": 2, "rope": 18}


def graph_us(fn: Callable[[], object], calls: int = CALLS, reps: int = 20) -> float:
    """Device microseconds per call: one CUDA graph of ``calls`` calls, median of ``reps`` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and allocate outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2] * 1e3 / calls


def eager_us(fn: Callable[[], object], calls: int = CALLS, reps: int = 10) -> float:
    """Microseconds per call of ``calls`` back-to-back eager calls (launch cost included), median."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2] * 1e3 / calls


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def kernel_cases(
    shape: str, t: int, device: str = "cuda"
) -> list[tuple[str, int, Callable[[], object], Callable[[], object], float]]:
    """``(kernel, bytes, fused call, torch call, rel err)`` for one shape and row count."""
    from phloem.runtime.layers import fused_triton
    from phloem.runtime.layers.activation import silu_and_mul_ref
    from phloem.runtime.layers.rmsnorm import add_rms_norm_ref, rms_norm_ref
    from phloem.runtime.layers.rotary import RotaryEmbedding, rope_ref

    hidden, width, hq, hk, dim = SHAPES[shape]
    e = DTYPE.itemsize
    gen = torch.Generator(device=device).manual_seed(t)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, device=device).to(DTYPE)

    x, res, w, eps = randn(t, hidden), randn(t, hidden), 1 + 0.1 * randn(hidden), 1e-5
    gate_up = randn(t, 2 * width)
    qkv = randn(t, (hq + 2 * hk) * dim)
    q, k, _ = qkv.split([hq * dim, hk * dim, hk * dim], dim=-1)
    q, k = q.view(t, hq, dim), k.view(t, hk, dim)
    positions = torch.randint(0, 4096, (t,), generator=gen, device=device)
    cos_sin = RotaryEmbedding(dim, 4096, 10000.0).to(device).cos_sin(positions)

    norm_err = _rel(fused_triton.rmsnorm(x, w, eps), rms_norm_ref(x, w, eps))
    add_err = _rel(fused_triton.add_rmsnorm(x, res, w, eps)[0], add_rms_norm_ref(x, res, w, eps)[0])
    silu_err = _rel(fused_triton.silu_and_mul(gate_up), silu_and_mul_ref(gate_up))
    ref_q, _ = rope_ref(q, k, cos_sin)
    rope_err = _rel(fused_triton.rope_(q.clone(), k.clone(), *cos_sin)[0], ref_q)
    return [
        ("add_rmsnorm", (4 * t * hidden + hidden) * e,
         lambda: fused_triton.add_rmsnorm(x, res, w, eps), lambda: add_rms_norm_ref(x, res, w, eps), add_err),
        ("rmsnorm", (2 * t * hidden + hidden) * e,
         lambda: fused_triton.rmsnorm(x, w, eps), lambda: rms_norm_ref(x, w, eps), norm_err),
        ("silu_and_mul", 3 * t * width * e,
         lambda: fused_triton.silu_and_mul(gate_up), lambda: silu_and_mul_ref(gate_up), silu_err),
        ("rope", 2 * t * (hq + hk) * dim * e + 4 * t * dim,
         lambda: fused_triton.rope_(q, k, *cos_sin), lambda: rope_ref(q, k, cos_sin), rope_err),
    ]  # fmt: skip


def bench_kernels(bandwidth: float) -> list[dict]:
    rows = []
    for shape in SHAPES:
        for t in ROWS:
            for name, nbytes, fused, ref, err in kernel_cases(shape, t):
                row = {
                    "kernel": name, "shape": shape, "rows": t, "bytes": nbytes,
                    "floor_us": round(nbytes / bandwidth * 1e6, 3),
                    "fused_graph_us": round(graph_us(fused), 3), "torch_graph_us": round(graph_us(ref), 3),
                    "fused_eager_us": round(eager_us(fused), 3), "torch_eager_us": round(eager_us(ref), 3),
                    "torch_kernels": TORCH_KERNELS[name], "rel_err": err,
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def step_speedups(steps: list[dict]) -> list[dict]:
    """Unfused / fused step time for each (model, graph, batch)."""
    by_key = {(r["model"], r["cuda_graph"], r["batch"], r["fused"]): r for r in steps}
    out = []
    for (model, graph, batch, fused), on in by_key.items():
        off = by_key.get((model, graph, batch, False))
        if not fused or off is None:
            continue
        row = {"model": model, "cuda_graph": graph, "batch": batch,
               "step_ms_off": off["step_ms"], "step_ms_on": on["step_ms"],
               "speedup": round(off["step_ms"] / on["step_ms"], 3)}  # fmt: skip
        if graph:
            row["replay_ms_off"], row["replay_ms_on"] = off["graph_replay_gpu_ms"], on["graph_replay_gpu_ms"]
            row["replay_speedup"] = round(off["graph_replay_gpu_ms"] / on["graph_replay_gpu_ms"], 3)
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "llama3-8b"], help="decode step shapes")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64, 256])
    ap.add_argument("--context", type=int, default=1024, help="KV tokens per request in the step")
    ap.add_argument("--skip-step", action="store_true", help="kernels only")
    args = ap.parse_args()

    _fast_dummy_weights()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    with torch.inference_mode():
        kernels = bench_kernels(bandwidth)
    steps, captures = [], {}
    if not args.skip_step:
        for shape in args.models:
            rows, caps = bench_model(
                shape, backends=["triton"], batches=args.batches, context=args.context,
                cuda_graph_max_bs=max(args.batches), fused_modes=["off", "on"], bandwidth=bandwidth,
            )  # fmt: skip
            steps += rows
            captures.update(caps)
    speedups = step_speedups(steps)
    report = {
        **run_record("fused_bench", DTYPE, bandwidth),
        "floor": "kernels: bytes / copy bandwidth; step: see decode_bench",
        "kernels": kernels,
        "step": steps,
        "step_speedups": speedups,
        "captures": captures,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_tables(kernels, speedups)
    return 0


def print_tables(kernels: list[dict], speedups: list[dict]) -> None:
    print(f"\n{'kernel':13} {'shape':6} {'rows':>4} {'floor us':>8} {'fused us':>8} {'torch us':>8} "
          f"{'x':>5} {'f eager':>8} {'t eager':>8} {'x':>5} {'rel err':>8}")  # fmt: skip
    for r in kernels:
        print(f"{r['kernel']:13} {r['shape']:6} {r['rows']:>4} {r['floor_us']:>8.2f} {r['fused_graph_us']:>8.2f} "
              f"{r['torch_graph_us']:>8.2f} {r['torch_graph_us'] / r['fused_graph_us']:>5.1f} "
              f"{r['fused_eager_us']:>8.2f} {r['torch_eager_us']:>8.2f} "
              f"{r['torch_eager_us'] / r['fused_eager_us']:>5.1f} {r['rel_err']:>8.1e}")  # fmt: skip
    if speedups:
        print(f"\n{'model':14} {'graph':5} {'batch':>5} {'off ms':>8} {'on ms':>8} {'x':>6} "
              f"{'replay off':>10} {'replay on':>10} {'x':>6}")  # fmt: skip
        for r in speedups:
            print(f"{r['model']:14} {r['cuda_graph']!s:5} {r['batch']:>5} {r['step_ms_off']:>8.3f} "
                  f"{r['step_ms_on']:>8.3f} {r['speedup']:>6.2f} {r.get('replay_ms_off') or '-':>10} "
                  f"{r.get('replay_ms_on') or '-':>10} {r.get('replay_speedup') or '-':>6}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
