"""Prefill attention alone: the pool kernel against the one that reads new keys contiguously.

The runtime's pool kernel (``triton_kernels.extend_attention``) reads every key through the
request's ``req_to_token`` row, one pool slot per key; ``triton_extend_contig`` reads the new
tokens' K/V as tiles of the contiguous projection output through tensor descriptors (TMA). One
prefill chunk like the offline workload's (16 prompts of 100-1,000 tokens, seeded, no cached
prefix), one layer, CUDA, compute capability 9.0 or later:

- ``pool``: ``extend_attention`` at its defaults over scattered slots;
- ``pool-contig``: the same over slots in token order (what the gather's scatter costs);
- ``contiguous``: ``extend_attention_contiguous`` at a few tile settings (queries / prefix keys /
  new keys a tile, warps, stages).

Outputs are compared with the pool kernel's on the same setup (the in-order slots).
``--prefix P --extend E``: every prompt has a cached prefix of P tokens and E new ones (a
radix-cache hit or a chunked prompt's later chunk), so the prefix phase, which both kernels read
through ``req_to_token``, is timed too.

    python3 -m benchmarks.gpu.extend_tma_probe --shape llama3-8b,qwen3-0.6b --out F
    python3 -m benchmarks.gpu.extend_tma_probe --shape llama3-8b --prefix 2048 --extend 128 --out F

(The eighteenth round's figures came from this script's first version, with the kernel in the
script and the pool kernel timed through ``TritonBackend.forward_extend``, which also writes the
new K/V: ``benchmarks/results/h200/round18/e/``.)
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

# (prefix keys a tile, new keys a tile, warps, stages); 64 queries a program. Without a prefix
# the first number changes nothing.
TILES = (
    (64, 64, 4, 3),
    (64, 64, 4, 2),
    (64, 32, 4, 3),
    (32, 32, 4, 3),
    (64, 32, 4, 2),
    (64, 32, 4, 4),
    (64, 16, 4, 3),
    (64, 64, 8, 3),
    (64, 32, 8, 3),
)


def probe(
    shape: str, bench, seed: int = 0, prompts: int = 16, prefix: int = 0, extend: int = 0
) -> list[dict]:
    """``prefix``: every prompt's cached prefix (read through ``req_to_token`` by both kernels);
    ``extend``: every prompt's new tokens (0: 100-1,000, seeded)."""
    from phloem.runtime.attention.triton_extend_contig import extend_attention_contiguous
    from phloem.runtime.attention.triton_kernels import extend_attention
    from phloem.runtime.executor.forward_io import ForwardMode

    from benchmarks.gpu.attention_bench import SHAPES, _backend, _setup

    hq, _, d = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    ext = [extend] * prompts if extend else torch.randint(100, 1001, (prompts,), generator=gen).tolist()
    # (query, key) pairs: the whole prefix, then causal among the new tokens
    flops = 4 * sum(prefix * e + e * (e + 1) // 2 for e in ext) * hq * d
    rows: list[dict] = []
    ref = None

    def record(name: str, settings: str, run) -> torch.Tensor:
        out = run().clone()
        ms = bench(run)
        diff = 0.0 if ref is None else float((out.float() - ref.float()).abs().max())
        rows.append({"shape": shape, "prefix": prefix, "variant": name, "settings": settings, "tokens": sum(ext), "ms": round(ms, 4),
                     "tflops": round(flops / ms / 1e9, 1), "max_diff_vs_pool": diff})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        return out

    for name, contiguous in (("pool", False), ("pool-contig", True)):
        torch.manual_seed(seed)  # the same pool contents and q, k, v for both
        pool, rtt, fi, q, k, v = _setup(
            shape, [prefix] * len(ext), ext, ForwardMode.EXTEND, contiguous=contiguous
        )
        tri = _backend("triton", pool, rtt, fi, hq)
        pool.set_kv(0, fi.out_slots, k, v)
        k_buf, v_buf = pool.get_kv(0)
        common = dict(
            req_to_token=rtt.req_to_token, req_pool_indices=fi.req_pool_indices, prefix_lens=fi.prefix_lens,
            extend_lens=fi.extend_lens, q_start=tri.q_start, block_req=tri.block_req, block_m=tri.block_m,
            sm_scale=d**-0.5,
        )  # fmt: skip
        out = record(
            name,
            "default",
            functools.partial(extend_attention, q, k_buf, v_buf, torch.empty_like(q), **common),
        )
        ref = out  # the contiguous tiles run on this (last) setup: compare with it
    for block_p, block_n, warps, stages in TILES:
        run = functools.partial(
            extend_attention_contiguous, q, k, v, k_buf, v_buf, torch.empty_like(q), **common,
            block_n=block_n, block_prefix=block_p, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        try:
            record("contiguous", f"64/{block_p}/{block_n}/{warps}/{stages}", run)
        except Exception as exc:  # out of resources for this tile
            print(
                f"skip {block_p}/{block_n}/{warps}/{stages}: {type(exc).__name__}: {str(exc)[:200]}",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--prefix", type=int, default=0, help="cached prefix of every prompt")
    ap.add_argument("--extend", type=int, default=0, help="new tokens of every prompt (0: 100-1,000)")
    ap.add_argument("--out")
    args = ap.parse_args()
    from triton.testing import do_bench

    def bench(f) -> float:
        return do_bench(f, warmup=5, rep=30, return_mode="median")

    rows = []
    for shape in args.shape.split(","):
        rows += probe(shape, bench, prefix=args.prefix, extend=args.extend)
    if args.out:
        with open(args.out, "w") as f:
            cmd = f"python3 -m benchmarks.gpu.extend_tma_probe --shape {args.shape}"
            cmd += f" --prefix {args.prefix} --extend {args.extend}" if args.prefix or args.extend else ""
            json.dump({"command": cmd, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
