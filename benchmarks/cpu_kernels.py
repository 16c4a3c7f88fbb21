"""Interleaved microbenchmark of the CPU projection kernels on the default model's layer shapes.

For each shape and row count, times one call of every kernel in turn (A, B, C, A, B, C, ...), each
call on the next of ``--copies`` distinct weights, never one the call before it read, so the
weights come from memory as in a decode step (one copy would stay in cache), and prints each
kernel's median.

Kernels: float32 ``F.linear`` (``--quantization none``), the weight-only int4 kernel
(``int4``: Q4_1 blocks, float activations), and the integer-dot kernel on the same Q4_1 blocks
(``gguf``) in every variant this CPU runs (AVX-512 VNNI, AVX2).

    python benchmarks/cpu_kernels.py [--threads 1] [--rounds 30] [--copies 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from phloem.runtime.layers import qdot
from phloem.runtime.layers.quant import Q4Weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _q4(n: int, k: int, seed: int) -> Q4Weight:
    gen = torch.Generator().manual_seed(seed)
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.15).half().float()
    return Q4Weight(qs, d, m)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--copies", type=int, default=64, help="distinct weights per shape (layers)")
    parser.add_argument("--rows", default="1,8,32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isas = qdot.supported_isas()
    print(f"threads={args.threads} kernels={isas}; median microseconds per call")
    for name, (n, k) in SHAPES.items():
        blocks = [_q4(n, k, i) for i in range(args.copies)]
        floats = [b.dequantize() for b in blocks]
        packed = [qdot.pack_q4(b) for b in blocks]
        calls: dict[str, Callable[..., object]] = {
            "none (float32)": lambda x, i, floats=floats: F.linear(x, floats[i]),
            "int4 (float act.)": lambda x, i, blocks=blocks: blocks[i].matmul(x),
        }
        for isa in isas:
            mod = qdot.build_kernels(isa)
            calls[f"gguf {isa}"] = lambda x, i, mod=mod, packed=packed, n=n: mod.q4_dot(x, packed[i], n)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            times: dict[str, list[float]] = {c: [] for c in calls}
            for r in range(args.rounds):
                for j, (c, fn) in enumerate(calls.items()):
                    t = time.perf_counter()
                    fn(x, (r * len(calls) + j) % args.copies)
                    times[c].append(time.perf_counter() - t)
            cells = "  ".join(f"{c} {statistics.median(v) * 1e6:8.1f}" for c, v in times.items())
            print(f"{name:8s} [{n}x{k}] rows {rows:3d}: {cells}")


if __name__ == "__main__":
    main()
