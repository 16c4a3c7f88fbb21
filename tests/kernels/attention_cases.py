"""Random paged-attention batches and the comparison against the ``torch_ref`` oracle.

Shared by the fast-backend tests (and by the Triton-interpreter run, which imports it in a
subprocess). Every call draws fresh inputs: scattered slots, a random ``req_to_token`` row per
request, random cached prefix K/V. ``kv_dtype=torch.float8_e4m3fn`` makes the pool fp8 (with
``kv_scales``); the oracle then runs on the dequantized pool, so the tolerance stays the compute
dtype's: it checks the kernels, not fp8 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from phloem.runtime.attention.registry import get_attention_backend_class
from phloem.runtime.cache.kv_pool import KVPool, ReqToTokenPool
from phloem.runtime.executor.model_runner import greedy_sampling_info
from phloem.runtime.forward_io import ForwardInput, ForwardMode

# ||out - ref|| / ||ref|| against a float64 torch_ref run on the same (upcast) inputs
REL_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Heads:
    q: int
    kv: int
    dim: int


# name -> (prefix_lens, extend_lens, mode)
BATCHES: dict[str, tuple[list[int], list[int], ForwardMode]] = {
    "extend_no_prefix": ([0], [37], ForwardMode.EXTEND),
    "extend_prefix": ([45], [19], ForwardMode.EXTEND),
    "extend_mixed": ([0, 130, 7, 64, 3], [33, 1, 70, 16, 0], ForwardMode.EXTEND),
    "extend_long": ([700, 0], [150, 260], ForwardMode.EXTEND),
    "extend_edges": ([64, 0, 3, 0, 200], [64, 128, 1, 5, 300], ForwardMode.EXTEND),
    "decode_mixed": ([0, 17, 300, 5, 1000], [1, 1, 1, 1, 1], ForwardMode.DECODE),
    "decode_long": ([2047], [1], ForwardMode.DECODE),
    "decode_batch64": ([(37 * i) % 900 for i in range(64)], [1] * 64, ForwardMode.DECODE),
}
HEADS = {
    "mha_d64": Heads(8, 8, 64),
    "gqa3_d64": Heads(9, 3, 64),
    "gqa4_d128": Heads(32, 8, 128),
    "gqa8_d128": Heads(16, 2, 128),
}
# Small enough for Triton's CPU interpreter
SMALL_BATCHES: dict[str, tuple[list[int], list[int], ForwardMode]] = {
    "extend_mixed_small": ([0, 40, 5], [9, 1, 70], ForwardMode.EXTEND),
    "decode_small": ([0, 17, 90], [1, 1, 1], ForwardMode.DECODE),
    # block edges: a prefix of exactly one key block, new tokens filling one and two query blocks
    # exactly, a single token, and a request whose last tile runs past the end of the batch
    "extend_edges_small": ([64, 0, 3, 0], [64, 128, 1, 5], ForwardMode.EXTEND),
}
SMALL_HEADS = {"gqa2_d64": Heads(4, 2, 64), "gqa4_d128": Heads(4, 1, 128)}
# Under the interpreter (``interpret_attention.py``) a decode case takes seconds, so the CPU run
# takes each value once rather than every combination; the compiled CUDA tests run full tables.
# fp8 pools: scales that make the kernels' folding visible (unit scales are in the CUDA table).
INTERPRETED_FP8_SCALES = {"scaled": (0.05, 0.02)}
# (compute dtype, qk_norm) of the decode kernel's new-token cases
INTERPRETED_NEW_KV = [("fp32", False), ("fp16", True)]
INTERPRETED_VIEW_TILES = (None, (64, 64), (16, 64))


def interpreted_cases(fp8: bool) -> int:
    """The ``ok`` lines a passing ``interpret_attention`` run prints: the small batches in fp32
    and fp16 (and an fp16 extend through the contiguous kernel too), then without ``fp8`` the
    contiguous kernel on qkv views and the decode kernel's new-token cases."""
    extend = sum(mode == ForwardMode.EXTEND for _, _, mode in SMALL_BATCHES.values())
    if fp8:
        return len(SMALL_HEADS) * len(SMALL_BATCHES) * 2 * len(INTERPRETED_FP8_SCALES)
    per_heads = len(SMALL_BATCHES) * 2 + extend + len(INTERPRETED_VIEW_TILES) + len(INTERPRETED_NEW_KV)
    return len(SMALL_HEADS) * per_heads


@dataclass
class Batch:
    pool: KVPool
    rtt: ReqToTokenPool
    fi: ForwardInput
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hk, D] new tokens
    v: torch.Tensor


def make_batch(
    prefix_lens: list[int],
    extend_lens: list[int],
    mode: ForwardMode,
    heads: Heads,
    *,
    dtype: torch.dtype,
    device: str,
    seed: int,
    kv_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] | None = None,
) -> Batch:
    """A batch whose requests sit in shuffled ``req_to_token`` rows over scattered slots.

    ``kv_dtype``: the pool's storage dtype (default ``dtype``); ``kv_scales``: its ``(k, v)``
    scales (fp8 pools only).
    """
    gen = torch.Generator().manual_seed(seed)
    total = sum(prefix_lens) + sum(extend_lens)
    num_slots = total + 64
    scales = {} if kv_scales is None else {"k_scales": [kv_scales[0]], "v_scales": [kv_scales[1]]}
    pool = KVPool(1, num_slots, heads.kv, heads.dim, kv_dtype or dtype, device, **scales)
    # Random garbage in unused slots: a kernel reading the wrong slot fails loudly.
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=gen) * 10)
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=gen) * 10)
    max_context = max(p + e for p, e in zip(prefix_lens, extend_lens)) + 5
    rtt = ReqToTokenPool(len(prefix_lens) + 3, max_context, device)
    row_order = torch.randperm(rtt.size, generator=gen)[: len(prefix_lens)].tolist()
    perm = torch.randperm(num_slots - 1, generator=gen) + 1  # never the padding slot
    used = 0
    out_slots = []
    for row, p, e in zip(row_order, prefix_lens, extend_lens):
        slots = perm[used : used + p + e]
        used += p + e
        rtt.req_to_token[row, : p + e] = slots.to(device)
        kp = torch.randn(p, heads.kv, heads.dim, generator=gen)
        vp = torch.randn(p, heads.kv, heads.dim, generator=gen)
        pool.set_kv(0, slots[:p].to(device), kp.to(device), vp.to(device))
        out_slots.append(slots[p:])
    ext = torch.tensor(extend_lens)
    t = int(ext.sum())
    fi = ForwardInput(
        mode=mode,
        input_ids=torch.zeros(t, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)]),
        out_slots=torch.cat(out_slots),
        req_pool_indices=torch.tensor(row_order),
        seq_lens=torch.tensor(prefix_lens) + ext,
        prefix_lens=torch.tensor(prefix_lens),
        extend_lens=ext,
        sampling=greedy_sampling_info(len(prefix_lens)),
    ).to(device)

    def rnd(h: int) -> torch.Tensor:
        return torch.randn(t, h, heads.dim, generator=gen).to(device=device, dtype=dtype)

    return Batch(pool, rtt, fi, rnd(heads.q), rnd(heads.kv), rnd(heads.kv))


def _clone_pool(pool: KVPool, dtype: torch.dtype) -> KVPool:
    """A ``dtype`` copy of ``pool`` holding its dequantized values (scales 1.0)."""
    out = KVPool(pool.num_layers, pool.num_slots, pool.num_kv_heads, pool.head_dim, dtype, pool.device)
    k_scale, v_scale = pool.get_kv_scales(0)
    out.k_buffer[0].copy_(pool.k_buffer[0].to(dtype) * k_scale)
    out.v_buffer[0].copy_(pool.v_buffer[0].to(dtype) * v_scale)
    return out


def compare_with_ref(
    backend_name: str, batch: Batch, num_heads: int, extend_kernel: str | None = None
) -> float:
    """Run ``backend_name`` and a float64 ``torch_ref`` on the same batch; return the relative error.

    Also checks that the new K/V landed in the pool at ``out_slots`` and that nothing is NaN. The
    oracle runs after the fast backend, on a float64 copy of the pool that then holds the new K/V
    as stored (for an fp8 pool: rounded to fp8), so both attend over the same values.
    ``extend_kernel`` (``"pool"`` or ``"contiguous"``, the Triton backend's extend): checks that
    the backend takes that kernel for this batch, so a case cannot pass on the other one.
    """
    dtype = batch.q.dtype
    fast = get_attention_backend_class(backend_name)(batch.pool, batch.rtt, num_heads=num_heads)
    fast.init_metadata(batch.fi)
    if extend_kernel is not None and batch.fi.mode == ForwardMode.EXTEND:
        from phloem.runtime.attention.triton_extend_contig import contiguous_extend_ok

        takes = (
            "contiguous"
            if contiguous_extend_ok(batch.q, batch.k, batch.v, batch.pool.get_kv(0)[0])
            else "pool"
        )
        assert takes == extend_kernel, f"the backend would run the {takes} extend kernel, not {extend_kernel}"
    out = fast.forward(batch.q, batch.k, batch.v, 0)
    if backend_name == "triton" and batch.fi.mode == ForwardMode.DECODE:
        _check_decode_variants(fast, batch, out)

    ref_pool = _clone_pool(batch.pool, torch.float64)
    ref = get_attention_backend_class("torch_ref")(ref_pool, batch.rtt, num_heads=num_heads)
    ref.init_metadata(batch.fi)
    k_new, v_new = ref_pool.gather_kv(0, batch.fi.out_slots, torch.float64)  # batch.k, v as stored
    expect = ref.forward(batch.q.double(), k_new, v_new, 0)

    assert out.shape == batch.q.shape and out.dtype == dtype
    assert not torch.isnan(out).any(), "NaN in output"
    _check_new_kv_landed(batch)
    err = float((out.double() - expect).norm() / expect.norm())
    assert err < REL_TOL[dtype], f"relative error {err:.3e} over {REL_TOL[dtype]:.0e}"
    return err


def check_contiguous_extend_on_views(
    heads: Heads, *, device: str, seed: int, tiles: tuple[int, int] | None = None
) -> float:
    """The contiguous extend kernel on q, k, v as the model hands them over: views into one fused
    qkv projection output (row stride (Hq + 2 Hk) * D), over cached prefixes and ragged new
    tokens, float16. Returns the relative error against ``torch_ref``. ``tiles``: (prefix keys,
    new keys) a tile, in place of what ``extend_tiles`` picks for the batch."""
    from phloem.runtime.attention import triton as triton_backend
    from phloem.runtime.attention import triton_extend_contig

    b = make_batch(
        [0, 40, 5, 67],
        [9, 1, 70, 130],
        ForwardMode.EXTEND,
        heads,
        dtype=torch.float16,
        device=device,
        seed=seed,
    )
    t, d = b.q.shape[0], heads.dim
    qkv = torch.empty(t, (heads.q + 2 * heads.kv) * d, dtype=b.q.dtype, device=device)
    q, k, v = qkv.split([heads.q * d, heads.kv * d, heads.kv * d], dim=-1)
    q, k, v = q.view(t, heads.q, d), k.view(t, heads.kv, d), v.view(t, heads.kv, d)
    q.copy_(b.q), k.copy_(b.k), v.copy_(b.v)
    views = Batch(b.pool, b.rtt, b.fi, q, k, v)
    mode, triton_extend_contig.MODE = triton_extend_contig.MODE, "contiguous"
    pick = triton_backend.extend_tiles
    if tiles is not None:
        triton_backend.extend_tiles = lambda _pairs: (tiles[1], tiles[0])  # (block_n, block_prefix)
    try:
        return compare_with_ref("triton", views, heads.q, extend_kernel="contiguous")
    finally:
        triton_extend_contig.MODE = mode
        triton_backend.extend_tiles = pick


def _check_decode_variants(fast, batch: Batch, out: torch.Tensor) -> None:
    """The decode kernel gives the same bits with its programs in either order (``heads_first``)
    and with either merge layout (``merge_grouped``), and the backend's output to rounding with
    each of its default launch settings."""
    from phloem.runtime.attention.triton_kernels import decode_attention

    k_buf, v_buf = batch.pool.get_kv(0)
    k_scale, v_scale = batch.pool.get_kv_scales(0)
    variants = [
        {"heads_first": False},
        {"heads_first": True},
        {"merge_grouped": False},
        {"merge_grouped": True},
    ]
    for variant in variants:
        again = decode_attention(
            batch.q, k_buf, v_buf, torch.empty_like(batch.q), fast.part_o, fast.part_lse,
            req_to_token=batch.rtt.req_to_token, req_pool_indices=fast.req_pool_indices,
            seq_lens=fast.seq_lens, sm_scale=fast.scale, k_scale=k_scale, v_scale=v_scale, **variant,
        )  # fmt: skip
        assert torch.equal(again, out), f"{variant} changed the decode output"
    # every default launch setting, whatever the batch picks: 64 and 128 keys a loop step
    for block_n, warps, stages in ((64, 2, 3), (128, 4, 2)):
        other = decode_attention(
            batch.q, k_buf, v_buf, torch.empty_like(batch.q), fast.part_o, fast.part_lse,
            req_to_token=batch.rtt.req_to_token, req_pool_indices=fast.req_pool_indices,
            seq_lens=fast.seq_lens, sm_scale=fast.scale, k_scale=k_scale, v_scale=v_scale,
            block_n=block_n, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        err = float((other.double() - out.double()).norm() / out.double().norm())
        assert err < REL_TOL[out.dtype], f"{block_n} keys, {warps} warps, {stages} stages: {err:.2e} off"


def _check_new_kv_landed(batch: Batch) -> None:
    """The new K/V are in the pool at ``out_slots``: exactly, or within fp8 rounding (3 mantissa
    bits: relative error <= 2^-4, absolute <= scale x 2^-10 among subnormals)."""
    pool, slots = batch.pool, batch.fi.out_slots
    if not pool.is_fp8:
        torch.testing.assert_close(pool.k_buffer[0][slots], batch.k.to(pool.dtype))
        torch.testing.assert_close(pool.v_buffer[0][slots], batch.v.to(pool.dtype))
        return
    k, v = pool.gather_kv(0, slots, torch.float64)
    for got, want, scale in zip((k, v), (batch.k, batch.v), pool.get_kv_scales(0)):
        torch.testing.assert_close(got, want.double(), rtol=2**-4, atol=scale * 2**-10)


def check_decode_new_kv(
    prefix_lens: list[int],
    heads: Heads,
    *,
    dtype: torch.dtype,
    device: str,
    seed: int,
    qk_norm: bool = False,
    kv_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] | None = None,
    via_backend: bool = False,
) -> float:
    """Decode with the step's token rotated and stored inside the decode kernel (``NewTokenKV``)
    against ``rope_store_`` followed by the plain decode kernel, on two copies of one pool.

    The pools must end equal: bit for bit outside the new tokens' slots, to the rotation's
    rounding in them (``rope_store_``'s own tolerance against ``rope_ref``); the outputs to the
    dtype's tolerance; ``q``, ``k``, ``v`` untouched. ``qk_norm``: Qwen3's per-head norms first.
    ``via_backend``: both sides go through ``TritonBackend.forward`` with RoPE tables (the path a
    model takes), switched by ``ROPE_IN_DECODE``, rather than through the kernels' functions.
    Returns the outputs' relative difference."""
    from phloem.runtime.attention import triton as triton_backend
    from phloem.runtime.attention.triton_kernels import NewTokenKV, decode_attention, decode_scratch
    from phloem.runtime.layers.fused_triton import rope_store_
    from phloem.runtime.layers.rotary import RotaryEmbedding

    b = make_batch(
        prefix_lens, [1] * len(prefix_lens), ForwardMode.DECODE, heads, dtype=dtype, device=device,
        seed=seed, kv_dtype=kv_dtype, kv_scales=kv_scales,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 100)
    cos_sin = RotaryEmbedding(heads.dim, 8192, 10000.0).to(device).cos_sin(b.fi.positions)
    norm = None
    if qk_norm:
        w = [(1 + 0.3 * torch.randn(heads.dim, generator=gen)).to(device=device, dtype=dtype) for _ in "qk"]
        norm = (w[0], w[1], 1e-6)
    q0, k0, v0 = b.q.clone(), b.k.clone(), b.v.clone()
    plain_pool = _clone_pool_exact(b.pool)
    slots, fi = b.fi.out_slots, b.fi
    if via_backend:
        from phloem.runtime.attention.base import QKNorm

        qkn = None if norm is None else QKNorm(*norm)
        outs = []
        for fused, pool in ((True, b.pool), (False, plain_pool)):
            old, triton_backend.ROPE_IN_DECODE = triton_backend.ROPE_IN_DECODE, fused
            try:
                be = triton_backend.TritonBackend(pool, b.rtt, num_heads=heads.q)
                be.init_metadata(fi)
                q = b.q if fused else b.q.clone()  # the unfused side rotates q in place
                outs.append(be.forward(q, b.k, b.v, 0, cos_sin=cos_sin, qk_norm=qkn))
            finally:
                triton_backend.ROPE_IN_DECODE = old
        out, plain = outs
    else:
        k_buf, v_buf = b.pool.get_kv(0)
        k_scale, v_scale = b.pool.get_kv_scales(0)
        part_o, part_lse = decode_scratch(len(prefix_lens), heads.q, heads.kv, heads.dim, device)
        kw = {
            "req_to_token": b.rtt.req_to_token, "req_pool_indices": fi.req_pool_indices,
            "seq_lens": fi.seq_lens, "sm_scale": heads.dim**-0.5, "k_scale": k_scale, "v_scale": v_scale,
        }  # fmt: skip
        new_kv = NewTokenKV(b.k, b.v, *cos_sin, slots, norm)
        out = decode_attention(
            b.q, k_buf, v_buf, torch.empty_like(b.q), part_o, part_lse, new_kv=new_kv, **kw
        )
        for prefetch in (False, True):  # the first block read before the PDL wait or after it
            again = decode_attention(
                b.q, k_buf, v_buf, torch.empty_like(b.q), part_o, part_lse, new_kv=new_kv, prefetch=prefetch, **kw
            )  # fmt: skip
            assert torch.equal(again, out), f"prefetch={prefetch} changed the decode output"
        q = b.q.clone()
        pk, pv = plain_pool.get_kv(0)
        rope_store_(q, b.k, b.v, *cos_sin, pk, pv, slots, qk_norm=norm, k_scale=k_scale, v_scale=v_scale)
        plain = decode_attention(q, pk, pv, torch.empty_like(q), part_o, part_lse, **kw)
    assert torch.equal(b.q, q0) and torch.equal(b.k, k0) and torch.equal(b.v, v0), "q, k or v changed"
    others = torch.ones(b.pool.num_slots, dtype=torch.bool, device=device)
    others[slots] = False
    for name, got, want in zip("KV", b.pool.get_kv(0), plain_pool.get_kv(0)):
        assert torch.equal(got[others].view(torch.uint8), want[others].view(torch.uint8)), (
            f"{name} outside the slots"
        )
        got_new, want_new = got[slots].double(), want[slots].double()
        close = (got_new - want_new).abs() <= 2**-7 * want_new.abs() + 1e-6  # the rotation's rounding
        if b.pool.is_fp8:  # an fp8 value one step up or down from a rounding difference before it
            close = close | ((got_new - want_new).abs() <= 2**-3 * want_new.abs() + 2**-9)
        assert bool(close.all()), f"new {name} differs from rope_store_'s by more than rounding"
    assert not torch.isnan(out).any(), "NaN in output"
    err = float((out.double() - plain.double()).norm() / plain.double().norm())
    assert err < REL_TOL[dtype], f"relative difference {err:.3e} over {REL_TOL[dtype]:.0e}"
    return err


def _clone_pool_exact(pool: KVPool) -> KVPool:
    """A copy of ``pool`` with the same dtype, bytes and scales."""
    k_scale, v_scale = pool.get_kv_scales(0)
    scales = {"k_scales": [k_scale], "v_scales": [v_scale]} if pool.is_fp8 else {}
    out = KVPool(
        pool.num_layers, pool.num_slots, pool.num_kv_heads, pool.head_dim, pool.dtype, pool.device, **scales
    )
    out.k_buffer[0].copy_(pool.k_buffer[0])
    out.v_buffer[0].copy_(pool.v_buffer[0])
    return out
