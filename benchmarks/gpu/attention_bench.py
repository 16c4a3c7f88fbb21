"""Attention kernels alone on a CUDA device: Triton vs torch_ref, against the floors (DESIGN.md §11).

Decode: ``B`` requests of ``--context`` keys each over scattered slots (one layer). Floor = K and V
bytes read / copy bandwidth. A small sweep of Triton launch settings (keys per step, warps) shows
how far the default is from the best one tried.

Extend: ragged new tokens over a cached prefix. Floor = attention FLOPs (causal, 4 per q-k pair
per head dim) / the bf16 matrix rate measured by an 8192^3 product.

Usage (in the repository root, on the GPU machine)::

    python3 -m benchmarks.gpu.attention_bench --out $OUT/attention_bench.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import torch
import triton
from triton.testing import do_bench

from benchmarks.gpu.decode_bench import copy_bandwidth

SHAPES = {
    "llama3-8b": (32, 8, 128),
    "smollm2-135m": (9, 3, 64),
    "qwen3-0.6b": (16, 8, 128),
}  # q heads, kv heads, head dim
DECODE_VARIANTS = [
    (64, None),
    (64, 4),
    (32, 4),
    (128, 4),
    (64, 8),
    (128, 8),
]  # (block_n, warps); None = default


def matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=200, return_mode="median")
    return 2 * n**3 / (ms / 1e3)


def _setup(
    shape: str,
    prefix_lens: list[int],
    extend_lens: list[int],
    mode,
    seed: int = 0,
    contiguous: bool = False,
    kv_dtype: torch.dtype = torch.bfloat16,
):
    from phloem.runtime.cache.kv_pool import KVPool, ReqToTokenPool
    from phloem.runtime.executor.forward_io import ForwardInput
    from phloem.runtime.executor.model_runner import greedy_sampling_info

    hq, hk, d = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    n = sum(seq)
    pool = KVPool(1, n + 1, hk, d, kv_dtype, "cuda")
    for buf in (pool.k_buffer[0], pool.v_buffer[0]):
        buf.copy_(torch.randn(buf.shape, device="cuda").to(kv_dtype))
    rtt = ReqToTokenPool(len(seq), max(seq), "cuda")
    perm = ((torch.arange(n) if contiguous else torch.randperm(n, generator=gen)) + 1).cuda()
    used, out_slots = 0, []
    for r, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        rtt.req_to_token[r, : p + e] = perm[used : used + p + e]
        out_slots.append(perm[used + p : used + p + e])
        used += p + e
    ext = torch.tensor(extend_lens)
    t = int(ext.sum())
    fi = ForwardInput(
        mode=mode,
        input_ids=torch.zeros(t, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)]),
        out_slots=torch.cat(out_slots).cpu(),
        req_pool_indices=torch.arange(len(seq)),
        seq_lens=torch.tensor(seq),
        prefix_lens=torch.tensor(prefix_lens),
        extend_lens=ext,
        sampling=greedy_sampling_info(len(seq)),
    ).to("cuda")
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    return pool, rtt, fi, q, k, v


def _backend(name: str, pool, rtt, fi, hq: int):
    from phloem.runtime.attention.registry import get_attention_backend_class

    b = get_attention_backend_class(name)(pool, rtt, num_heads=hq)
    b.init_metadata(fi)
    return b


def bench_decode(shape: str, bs: int, context: int, bandwidth: float) -> list[dict]:
    from phloem.runtime.attention.triton_kernels import decode_attention
    from phloem.runtime.executor.forward_io import ForwardMode

    hq, hk, d = SHAPES[shape]
    pool, rtt, fi, q, k, v = _setup(shape, [context - 1] * bs, [1] * bs, ForwardMode.DECODE)
    kv_bytes = bs * context * hk * d * 2 * 2
    floor_ms = kv_bytes / bandwidth * 1e3
    rows = []
    ref = _backend("torch_ref", pool, rtt, fi, hq)
    ms = do_bench(lambda: ref.forward_decode(q, k, v, 0), warmup=10, rep=50, return_mode="median")
    rows.append({"backend": "torch_ref", "settings": "-", "ms": ms})
    tri = _backend("triton", pool, rtt, fi, hq)
    ms = do_bench(lambda: tri.forward_decode(q, k, v, 0), warmup=10, rep=50, return_mode="median")
    rows.append({"backend": "triton", "settings": "default (with KV write)", "ms": ms})
    k_buf, v_buf = pool.get_kv(0)
    out = torch.empty_like(q)
    for block_n, warps in DECODE_VARIANTS:

        def run(block_n=block_n, warps=warps):
            decode_attention(
                q, k_buf, v_buf, out, tri.part_o, tri.part_lse,
                req_to_token=rtt.req_to_token, req_pool_indices=fi.req_pool_indices,
                seq_lens=fi.seq_lens, sm_scale=tri.scale, block_n=block_n, num_warps=warps,
            )  # fmt: skip

        ms = do_bench(run, warmup=10, rep=50, return_mode="median")
        rows.append(
            {"backend": "triton", "settings": f"kernel only, block_n={block_n} warps={warps}", "ms": ms}
        )
    for r in rows:
        r.update(
            kind="decode", shape=shape, batch=bs, context=context, bytes=kv_bytes,
            floor_ms=round(floor_ms, 4), ratio=round(r["ms"] / floor_ms, 2), ms=round(r["ms"], 4),
            splits=tri.part_lse.shape[2],
        )  # fmt: skip
    return rows


def sweep_decode(
    shape: str, bs: int, context: int, bandwidth: float, kv_dtype: torch.dtype = torch.bfloat16, grid=None
) -> list[dict]:
    """Every (keys per step, warps, stages) of the decode kernel for one case, over scattered
    slots and over each request's slots in one run (the allocator's usual layout). An fp8 pool
    also sweeps the float16 dot against the bfloat16 one."""
    hk, d = SHAPES[shape][1:]
    floor_ms = bs * context * hk * d * 2 * kv_dtype.itemsize / bandwidth * 1e3
    rows = []
    for contiguous in (False, True):
        part = _sweep_layout(shape, bs, context, contiguous, kv_dtype, grid or DECODE_GRID)
        for r in part:
            r.update(floor_ms=round(floor_ms, 4), ratio=round(r["ms"] / floor_ms, 2))
        for r in sorted(part, key=lambda r: r["ms"])[:5]:
            print(json.dumps(r), flush=True)
        rows += part
    return rows


DECODE_GRID = ((32, 64, 128, 256), (2, 4, 8), (2, 3, 4))  # keys per step, warps, stages


def _sweep_layout(
    shape: str, bs: int, context: int, contiguous: bool, kv_dtype: torch.dtype, grid
) -> list[dict]:
    from phloem.runtime.attention.triton_kernels import decode_attention
    from phloem.runtime.executor.forward_io import ForwardMode

    hq = SHAPES[shape][0]
    pool, rtt, fi, q, _, _ = _setup(
        shape, [context - 1] * bs, [1] * bs, ForwardMode.DECODE, contiguous=contiguous, kv_dtype=kv_dtype
    )
    tri = _backend("triton", pool, rtt, fi, hq)
    k_buf, v_buf = pool.get_kv(0)
    out = torch.empty_like(q)

    def run(block_n: int, warps: int, stages: int, f16: bool | None) -> None:
        decode_attention(
            q, k_buf, v_buf, out, tri.part_o, tri.part_lse,
            req_to_token=rtt.req_to_token, req_pool_indices=fi.req_pool_indices,
            seq_lens=fi.seq_lens, sm_scale=tri.scale, block_n=block_n, num_warps=warps, num_stages=stages,
            f16_dot=f16,
        )  # fmt: skip

    rows = []
    for f16 in (True, False) if kv_dtype.itemsize == 1 else (None,):
        for block_n in grid[0]:
            for warps in grid[1]:
                for stages in grid[2]:
                    try:
                        ms = do_bench(lambda b=block_n, w=warps, st=stages, h=f16: run(b, w, st, h), warmup=5,
                                      rep=30, return_mode="median")  # fmt: skip
                    except Exception as exc:  # out of resources for this tile
                        print(f"skip {block_n}/{warps}/{stages}: {type(exc).__name__}", flush=True)
                        continue
                    rows.append({"kind": "decode-sweep", "shape": shape, "batch": bs, "context": context,
                                 "contiguous": contiguous, "kv_dtype": str(kv_dtype).split(".")[-1],
                                 "f16_dot": f16, "block_n": block_n, "warps": warps, "stages": stages,
                                 "ms": round(ms, 4), "splits": tri.part_lse.shape[2]})  # fmt: skip
    return rows


SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


def sweep_splits(shape: str, batches: list[int], bandwidth: float) -> list[dict]:
    """Decode kernel time per number of key-axis splits at each batch size, for contexts of 1,024
    keys and for ragged contexts (uniform in [100, 2048], seeded: the offline workload's spread).
    The default rule is :func:`decode_num_splits`; this shows what it leaves on the table."""
    from phloem.runtime.attention.triton_kernels import decode_attention, decode_num_splits
    from phloem.runtime.executor.forward_io import ForwardMode

    hq, hk, d = SHAPES[shape]
    rows = []
    for bs in batches:
        gen = torch.Generator().manual_seed(bs)
        layouts = {
            "uniform": [1024] * bs,
            "ragged": torch.randint(100, 2049, (bs,), generator=gen).tolist(),
        }
        default = decode_num_splits(bs, hk, d)
        for layout, ctx in layouts.items():
            pool, rtt, fi, q, _, _ = _setup(shape, [c - 1 for c in ctx], [1] * bs, ForwardMode.DECODE)
            k_buf, v_buf = pool.get_kv(0)
            out = torch.empty_like(q)
            floor_ms = sum(ctx) * hk * d * 2 * 2 / bandwidth * 1e3
            case = []
            for splits in sorted(set(SPLITS) | {default}):
                part_o = torch.empty((bs, hq, splits, d), dtype=torch.float32, device="cuda")
                part_lse = torch.empty((bs, hq, splits), dtype=torch.float32, device="cuda")
                run = functools.partial(
                    decode_attention, q, k_buf, v_buf, out, part_o, part_lse,
                    req_to_token=rtt.req_to_token, req_pool_indices=fi.req_pool_indices,
                    seq_lens=fi.seq_lens, sm_scale=d**-0.5,
                )  # fmt: skip
                ms = do_bench(run, warmup=5, rep=30, return_mode="median")
                case.append({"kind": "decode-splits", "shape": shape, "batch": bs, "layout": layout,
                             "mean_context": round(sum(ctx) / bs), "splits": splits, "default_splits": default,
                             "ms": round(ms, 4), "floor_ms": round(floor_ms, 4),
                             "ratio": round(ms / floor_ms, 2)})  # fmt: skip
            best = min(case, key=lambda r: r["ms"])
            now = next(r for r in case if r["splits"] == default)
            print(f"{shape} B={bs} {layout}: default S={default} x{now['ratio']}, "
                  f"best S={best['splits']} x{best['ratio']}", flush=True)  # fmt: skip
            rows += case
    return rows


def order_ab(shape: str, bs: int, context: int, bandwidth: float, decode_share: float = 0.5) -> list[dict]:
    """The decode kernel with its programs in request-major order against KV-head-major order
    (``heads_first``, the default), alternating, over three slot layouts: scattered, each request
    in one run, and the offline run's layout (each prompt in one run, then the generated tokens
    one slot per step across the batch: ``decode_share`` of the keys)."""
    from phloem.runtime.attention.triton_kernels import decode_attention
    from phloem.runtime.executor.forward_io import ForwardMode

    hq, hk, d = SHAPES[shape]
    floor_ms = bs * context * hk * d * 2 * 2 / bandwidth * 1e3
    rows = []
    for layout in ("scattered", "contiguous", "prompt+steps"):
        pool, rtt, fi, q, _, _ = _setup(
            shape, [context - 1] * bs, [1] * bs, ForwardMode.DECODE, contiguous=layout != "scattered"
        )
        if layout == "prompt+steps":
            prompt = int(context * (1 - decode_share))
            slots = torch.empty(bs, context, dtype=torch.int64)
            slots[:, :prompt] = 1 + torch.arange(bs * prompt).view(bs, prompt)
            steps = context - prompt
            slots[:, prompt:] = 1 + bs * prompt + torch.arange(steps * bs).view(steps, bs).t()
            rtt.req_to_token[:bs, :context] = slots.to(rtt.req_to_token)
        tri = _backend("triton", pool, rtt, fi, hq)
        k_buf, v_buf = pool.get_kv(0)
        out = torch.empty_like(q)
        outs = {}
        for rep in range(3):
            for heads_first in (False, True):
                run = functools.partial(
                    decode_attention, q, k_buf, v_buf, out, tri.part_o, tri.part_lse,
                    req_to_token=rtt.req_to_token, req_pool_indices=fi.req_pool_indices,
                    seq_lens=fi.seq_lens, sm_scale=tri.scale, heads_first=heads_first,
                )  # fmt: skip
                ms = do_bench(run, warmup=10, rep=50, return_mode="median")
                outs[heads_first] = out.clone()
                rows.append({"kind": "decode-order", "shape": shape, "batch": bs, "context": context,
                             "layout": layout, "heads_first": heads_first, "rep": rep, "ms": round(ms, 4),
                             "floor_ms": round(floor_ms, 4), "ratio": round(ms / floor_ms, 3)})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
        assert torch.equal(outs[False], outs[True]), "the program order changed the result"
    return rows


RAGGED_TILES = ((64, 2, 3), (128, 4, 3), (128, 4, 2), (64, 4, 3), (128, 2, 3))  # block_n, warps, stages
RAGGED_SPLITS = (1, 2, 3, 4, 6)


def offline_layout(ctx: list[int]) -> torch.Tensor:
    """``req_to_token`` rows as the offline run leaves them: each prompt (the first half of its
    keys, rounded up) in one run of slots, then the generated keys one slot per step across the
    requests still going. Slots start at 1."""
    width = max(ctx)
    slots = torch.zeros(len(ctx), width, dtype=torch.int64)
    nxt = 1
    prompts = [c - c // 2 for c in ctx]
    for r, p in enumerate(prompts):
        slots[r, :p] = nxt + torch.arange(p)
        nxt += p
    for step in range(width):
        for r, (c, p) in enumerate(zip(ctx, prompts)):
            if p + step < c:
                slots[r, p + step] = nxt
                nxt += 1
    return slots


def sweep_ragged(shape: str, batches: list[int], bandwidth: float, reps: int = 3) -> list[dict]:
    """The decode kernel's launch settings and split counts on the offline run's workload:
    contexts uniform in [100, 2048] (seeded per batch size) in the offline slot layout. The
    settings are interleaved and repeated ``reps`` times; ms is the median over repetitions."""
    from phloem.runtime.attention.triton_kernels import decode_attention, decode_num_splits
    from phloem.runtime.executor.forward_io import ForwardMode

    hq, hk, d = SHAPES[shape]
    rows = []
    for bs in batches:
        ctx = torch.randint(100, 2049, (bs,), generator=torch.Generator().manual_seed(bs)).tolist()
        pool, rtt, fi, q, _, _ = _setup(shape, [c - 1 for c in ctx], [1] * bs, ForwardMode.DECODE)
        rtt.req_to_token[:bs, : max(ctx)] = offline_layout(ctx).to(rtt.req_to_token)
        k_buf, v_buf = pool.get_kv(0)
        floor_ms = sum(ctx) * hk * d * 2 * 2 / bandwidth * 1e3
        default = decode_num_splits(bs, hk, d)
        cases = [(t, s) for t in RAGGED_TILES for s in sorted(set(RAGGED_SPLITS) | {default})]
        times: dict = {c: [] for c in cases}
        for _ in range(reps):
            for (block_n, warps, stages), splits in cases:
                part_o = torch.empty((bs, hq, splits, d), dtype=torch.float32, device="cuda")
                part_lse = torch.empty((bs, hq, splits), dtype=torch.float32, device="cuda")
                run = functools.partial(
                    decode_attention, q, k_buf, v_buf, torch.empty_like(q), part_o, part_lse,
                    req_to_token=rtt.req_to_token, req_pool_indices=fi.req_pool_indices,
                    seq_lens=fi.seq_lens, sm_scale=d**-0.5, block_n=block_n, num_warps=warps,
                    num_stages=stages,
                )  # fmt: skip
                times[((block_n, warps, stages), splits)].append(do_bench(run, warmup=10, rep=40))
        case = []
        for ((block_n, warps, stages), splits), ms in times.items():
            med = sorted(ms)[len(ms) // 2]
            case.append({"kind": "decode-ragged", "shape": shape, "batch": bs, "mean_context": round(sum(ctx) / bs),
                         "block_n": block_n, "warps": warps, "stages": stages, "splits": splits,
                         "default_splits": default, "ms": round(med, 4), "floor_ms": round(floor_ms, 4),
                         "ratio": round(med / floor_ms, 3)})  # fmt: skip
        now = next(
            r for r in case if (r["block_n"], r["warps"], r["stages"], r["splits"]) == (64, 2, 3, default)
        )
        print(f"{shape} B={bs}: default x{now['ratio']} ({now['ms']} ms)", flush=True)
        for r in sorted(case, key=lambda r: r["ms"])[:6]:
            print(
                f"  {r['block_n']}/{r['warps']}/{r['stages']} S={r['splits']}: {r['ms']} ms x{r['ratio']}",
                flush=True,
            )
        rows += case
    return rows


EXTEND_GRID = ((64, 128), (32, 64, 128), (4, 8), (1, 2, 3))  # query block, key block, warps, stages


def sweep_extend(shape: str, rate: float, kv_dtype: torch.dtype = torch.bfloat16, grid=None) -> list[dict]:
    """Every (query block, key block, warps, stages) of the extend kernel on one prefill chunk
    like the offline workload's: 16 prompts of 100-1,000 tokens (seeded), no cached prefix. An fp8
    pool runs every setting with float16 dots and with bfloat16 dots (``f16_dot``)."""
    from phloem.runtime.attention.triton_kernels import extend_attention, extend_block_table
    from phloem.runtime.executor.forward_io import ForwardMode

    hq, _, d = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    ext = torch.randint(100, 1001, (16,), generator=gen).tolist()
    pool, rtt, fi, q, k, v = _setup(shape, [0] * len(ext), ext, ForwardMode.EXTEND, kv_dtype=kv_dtype)
    tri = _backend("triton", pool, rtt, fi, hq)
    k_scale, v_scale = pool.get_kv_scales(0) if kv_dtype.itemsize == 1 else (1.0, 1.0)
    ref = tri.forward_extend(q, k, v, 0)  # default settings; writes the new K/V
    k_buf, v_buf = pool.get_kv(0)
    out = torch.empty_like(q)
    pairs = sum(e * (e + 1) // 2 for e in ext)
    floor_ms = 4 * pairs * hq * d / rate * 1e3
    rows = []
    settings = itertools.product(*(grid or EXTEND_GRID), (True, False) if kv_dtype.itemsize == 1 else (None,))
    for block_m, block_n, warps, stages, f16 in settings:
        block_req, block_idx = extend_block_table(fi.extend_lens, fi.num_tokens, block_m)
        run = functools.partial(
            extend_attention, q, k_buf, v_buf, out,
            req_to_token=rtt.req_to_token, req_pool_indices=fi.req_pool_indices,
            prefix_lens=fi.prefix_lens, extend_lens=fi.extend_lens, q_start=tri.q_start,
            block_req=block_req, block_m=block_idx, sm_scale=d**-0.5, k_scale=k_scale,
            v_scale=v_scale, block_size_m=block_m, block_n=block_n, num_warps=warps,
            num_stages=stages, f16_dot=f16,
        )  # fmt: skip
        try:
            ms = do_bench(run, warmup=5, rep=30, return_mode="median")
        except Exception as exc:  # out of resources for this tile
            print(f"skip {block_m}/{block_n}/{warps}/{stages}: {type(exc).__name__}", flush=True)
            continue
        rows.append({"kind": "extend-sweep", "shape": shape, "tokens": sum(ext), "block_m": block_m,
                     "kv_dtype": str(kv_dtype).split(".")[-1], "f16_dot": f16,
                     "block_n": block_n, "warps": warps, "stages": stages, "ms": round(ms, 4),
                     "floor_ms": round(floor_ms, 4), "ratio": round(ms / floor_ms, 2),
                     "tflops": round(4 * pairs * hq * d / ms / 1e9, 1),
                     "max_diff_vs_default": float((out.float() - ref.float()).abs().max())})  # fmt: skip
    for r in sorted(rows, key=lambda r: r["ms"])[:5]:
        print(json.dumps(r), flush=True)
    return rows


def bench_extend(shape: str, prefix: int, extend: int, reqs: int, rate: float) -> list[dict]:
    from phloem.runtime.executor.forward_io import ForwardMode

    hq, hk, d = SHAPES[shape]
    pool, rtt, fi, q, k, v = _setup(shape, [prefix] * reqs, [extend] * reqs, ForwardMode.EXTEND)
    pairs = reqs * (extend * prefix + extend * (extend + 1) // 2)  # visible (query, key) pairs
    flops = 4 * pairs * hq * d
    floor_ms = flops / rate * 1e3
    rows = []
    for name in ("torch_ref", "triton"):
        b = _backend(name, pool, rtt, fi, hq)
        ms = do_bench(lambda b=b: b.forward_extend(q, k, v, 0), warmup=5, rep=30, return_mode="median")
        rows.append(
            {"kind": "extend", "shape": shape, "backend": name, "requests": reqs, "prefix": prefix,
             "extend": extend, "flops": flops, "ms": round(ms, 4), "floor_ms": round(floor_ms, 4),
             "ratio": round(ms / floor_ms, 2), "tflops": round(flops / ms / 1e9, 1)}
        )  # fmt: skip
    return rows


def _write_sweep(path: str, flag: str, rows: list[dict]) -> int:
    with open(path, "w") as f:
        json.dump({"benchmark": f"attention_bench {flag}", "git_commit": os.environ.get("GIT_COMMIT", "unknown"),
                   "command": "python3 -m benchmarks.gpu.attention_bench " + " ".join(sys.argv[1:]),
                   "device": torch.cuda.get_device_name(), "results": rows}, f, indent=1)  # fmt: skip
    return 0


def _grid(spec: str) -> tuple[tuple[int, ...], ...]:
    """``"64,128:4,8:3"`` -> ``((64, 128), (4, 8), (3,))``: the values of each setting."""
    return tuple(tuple(int(x) for x in part.split(",")) for part in spec.split(":"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--decode-sweep", metavar="SHAPE:BATCH:CONTEXT",
                    help="only sweep the decode kernel's settings for this case")  # fmt: skip
    ap.add_argument("--split-sweep", metavar="SHAPE:B1,B2,...",
                    help="only time the decode kernel per number of key splits at these batch sizes")  # fmt: skip
    ap.add_argument("--order-ab", metavar="SHAPE:BATCH:CONTEXT",
                    help="only time the decode kernel's program orders against each other")  # fmt: skip
    ap.add_argument("--ragged-sweep", metavar="SHAPE:B1,B2,...",
                    help="only time the decode kernel's settings and splits on ragged offline-layout batches")  # fmt: skip
    ap.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "fp8_e4m3"],
                    help="pool dtype of --decode-sweep")  # fmt: skip
    ap.add_argument("--decode-grid", metavar="BLOCK_NS:WARPS:STAGES",
                    help="settings of --decode-sweep, e.g. 64,128:2,4:3 (default: all)")  # fmt: skip
    ap.add_argument("--extend-grid", metavar="BLOCK_MS:BLOCK_NS:WARPS:STAGES",
                    help="--extend-sweep: these settings only (default: the full grid)")  # fmt: skip
    ap.add_argument("--extend-sweep", metavar="SHAPE",
                    help="only sweep the extend kernel's settings on one prefill chunk of this shape")  # fmt: skip
    args = ap.parse_args()
    if args.extend_sweep:
        kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8_e4m3" else torch.bfloat16
        grid = _grid(args.extend_grid) if args.extend_grid else None
        rows = sweep_extend(args.extend_sweep, matmul_rate(), kv_dtype, grid)
        return _write_sweep(args.out, "--extend-sweep", rows)
    if args.split_sweep:
        shape, batches = args.split_sweep.split(":")
        rows = sweep_splits(shape, [int(b) for b in batches.split(",")], copy_bandwidth())
        return _write_sweep(args.out, "--split-sweep", rows)
    if args.order_ab:
        shape, bs, ctx = args.order_ab.split(":")
        return _write_sweep(args.out, "--order-ab", order_ab(shape, int(bs), int(ctx), copy_bandwidth()))
    if args.ragged_sweep:
        shape, batches = args.ragged_sweep.split(":")
        rows = sweep_ragged(shape, [int(b) for b in batches.split(",")], copy_bandwidth())
        return _write_sweep(args.out, "--ragged-sweep", rows)
    if args.decode_sweep:
        shape, bs, ctx = args.decode_sweep.split(":")
        kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8_e4m3" else torch.bfloat16
        grid = _grid(args.decode_grid) if args.decode_grid else None
        rows = sweep_decode(shape, int(bs), int(ctx), copy_bandwidth(), kv_dtype, grid)
        return _write_sweep(args.out, "--decode-sweep", rows)
    bandwidth, rate = copy_bandwidth(), matmul_rate()
    print(f"copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for shape in ("llama3-8b", "smollm2-135m"):
        for bs in (1, 64, 256):
            rows += bench_decode(shape, bs, args.context, bandwidth)
        rows += bench_extend(shape, 0, 2048, 4, rate)
        rows += bench_extend(shape, 2048, 512, 4, rate)
    report = {
        "benchmark": "attention_bench",
        "command": "python3 -m benchmarks.gpu.attention_bench " + " ".join(sys.argv[1:]),
        "git_commit": os.environ.get("GIT_COMMIT", "unknown"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_bandwidth_bytes_s": bandwidth,
        "bf16_matmul_flop_s": rate,
        "floor": "decode: K+V bytes / copy bandwidth; extend: causal attention FLOPs / bf16 matmul rate",
        "results": rows,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for r in rows:
        what = (
            f"B={r['batch']} ctx={r['context']}"
            if r["kind"] == "decode"
            else f"{r['requests']}x p={r['prefix']} e={r['extend']}"
        )
        print(f"{r['kind']:6} {r['shape']:13} {what:18} {r['backend']:9} {r.get('settings', ''):38} "
              f"{r['ms']:8.4f} ms  floor {r['floor_ms']:7.4f}  x{r['ratio']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
