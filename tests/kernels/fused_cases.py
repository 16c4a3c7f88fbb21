"""Fused layer kernels against their torch references on fresh random inputs.

Shared by ``test_fused_triton.py`` (compiled kernels on CUDA) and, run as a script, by Triton's
CPU interpreter (``python -m tests.kernels.fused_cases`` with ``TRITON_INTERPRET=1``; the test
starts it in a child process because the switch must be set before Triton is imported). Each
check runs the fused kernel first, on fresh inputs, then the reference, so an output the kernel
failed to write cannot hold the reference's values.
"""

from __future__ import annotations

import os
import sys

import torch

# ||fused - ref|| / ||ref||; both round to the dtype, so the gap is a few last-place differences
REL_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
FP8 = torch.float8_e4m3fn  # the fp8 KV pool's storage dtype
# Triton's interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest even: there,
# bf16 results get a looser bound and x + residual is not compared bit for bit.
INTERPRETER_BF16_TOL = 2e-2
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# rows x hidden; decode-like (1, 64, 256 rows) at SmolLM2-135M and Llama-3-8B widths, plus ragged
NORM_SHAPES = [(1, 576), (64, 576), (256, 576), (1, 4096), (64, 4096), (256, 4096), (7, 1000), (3, 8192)]
SILU_SHAPES = [(1, 1536), (64, 1536), (256, 1536), (1, 14336), (64, 14336), (9, 1000)]  # rows x I
# tokens, q heads, k heads, head dim
ROPE_SHAPES = [(1, 9, 3, 64), (64, 9, 3, 64), (256, 9, 3, 64), (1, 32, 8, 128), (64, 32, 8, 128),
               (13, 16, 2, 128), (5, 4, 4, 32)]  # fmt: skip
# Small enough for the interpreter
SMALL_NORM_SHAPES = [(1, 64), (5, 100)]
SMALL_SILU_SHAPES = [(1, 96), (4, 70), (2, 1100)]
SMALL_ROPE_SHAPES = [(3, 4, 2, 16), (2, 9, 3, 64)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_close(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float | None = None) -> float:
    """Same shape and dtype, every element written, relative error within ``tol`` (default: the
    dtype's :data:`REL_TOL`, looser for bfloat16 under the interpreter); returns the error."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (
        f"{name}: {out.shape} {out.dtype} vs {ref.shape}"
    )
    assert bool(torch.isfinite(out).all()), f"{name}: non-finite output (unwritten elements?)"
    err = rel_err(out, ref)
    if tol is None:
        tol = INTERPRETER_BF16_TOL if ref.dtype == torch.bfloat16 and _interpreted() else REL_TOL[ref.dtype]
    assert err <= tol, f"{name}: rel err {err:.2e} > {tol:.0e}"
    return err


def check_rmsnorm(shape: tuple[int, int], dtype: torch.dtype, device: str, seed: int) -> float:
    """Plain and residual RMSNorm on ``[rows, hidden]``, and plain RMSNorm over the heads of a
    strided ``[rows, 3, hidden / 3]``-like view (the q/k norm case); returns the worst error."""
    from phloem.runtime.layers import fused_triton
    from phloem.runtime.layers.rmsnorm import add_rms_norm_ref, rms_norm_ref

    gen = torch.Generator(device=device).manual_seed(seed)
    rows, hidden = shape

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, device=device, dtype=torch.float32).to(dtype)

    x, residual = randn(rows, hidden), randn(rows, hidden) * 4
    weight = 1 + 0.3 * randn(hidden)
    eps = 1e-5 if seed % 2 else 1e-6
    errs = []
    out = fused_triton.rmsnorm(x, weight, eps)
    errs.append(check_close("rmsnorm", out, rms_norm_ref(x, weight, eps)))
    x_before, res_before = x.clone(), residual.clone()
    out, new_res = fused_triton.add_rmsnorm(x, residual, weight, eps)
    ref, ref_res = add_rms_norm_ref(x, residual, weight, eps)
    assert torch.equal(x, x_before) and torch.equal(residual, res_before), "add_rmsnorm changed its inputs"
    if dtype != torch.bfloat16 or not _interpreted():  # x + residual rounds the same way everywhere
        assert torch.equal(new_res, ref_res), "add_rmsnorm: residual differs from x + residual"
    else:
        errs.append(check_close("add_rmsnorm residual", new_res, ref_res))
    errs.append(check_close("add_rmsnorm", out, ref))
    # per-head norm on a strided view: q of a fused [rows, (heads + 2) * dim] projection
    heads, dim = 3, max(16, hidden // 8)
    qkv = randn(rows, (heads + 2) * dim)
    q = qkv[:, : heads * dim].view(rows, heads, dim)
    head_w = 1 + 0.3 * randn(dim)
    errs.append(
        check_close("rmsnorm heads", fused_triton.rmsnorm(q, head_w, eps), rms_norm_ref(q, head_w, eps))
    )
    return max(errs)


def check_silu_and_mul(shape: tuple[int, int], dtype: torch.dtype, device: str, seed: int) -> float:
    from phloem.runtime.layers import fused_triton
    from phloem.runtime.layers.activation import silu_and_mul_ref

    gen = torch.Generator(device=device).manual_seed(seed)
    rows, width = shape
    gate_up = (torch.randn((rows, 2 * width), generator=gen, device=device) * 3).to(dtype)
    out = fused_triton.silu_and_mul(gate_up)
    return check_close("silu_and_mul", out, silu_and_mul_ref(gate_up))


def check_rope(shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, seed: int) -> float:
    """In-place RoPE on q and k as strided views of one fused qkv tensor; v must stay untouched."""
    from phloem.runtime.layers import fused_triton
    from phloem.runtime.layers.rotary import RotaryEmbedding, rope_ref

    gen = torch.Generator(device=device).manual_seed(seed)
    t, hq, hk, dim = shape
    rotary = RotaryEmbedding(dim, 8192, 10000.0).to(device)
    positions = torch.randint(0, 8192, (t,), generator=gen, device=device)
    cos_sin = rotary.cos_sin(positions)  # [T, 1, D/2] float32 each
    qkv = torch.randn((t, (hq + 2 * hk) * dim), generator=gen, device=device).to(dtype)
    q, k, v = qkv.split([hq * dim, hk * dim, hk * dim], dim=-1)
    q, k = q.view(t, hq, dim), k.view(t, hk, dim)  # [T, H, D], row stride (hq + 2 hk) * dim
    ref_q, ref_k = rope_ref(q.clone(), k.clone(), cos_sin)
    v_before = v.clone()
    out_q, out_k = fused_triton.rope_(q, k, *cos_sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr(), "rope_ is not in place"
    assert torch.equal(v, v_before), "rope_ wrote outside q and k"
    return max(check_close("rope q", q, ref_q), check_close("rope k", k, ref_k))


def check_rope_store(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: str,
    seed: int,
    qk_norm: bool = False,
    k_inplace: bool = False,
) -> float:
    """RoPE fused with the K/V write: q rotated in place, ``k_buf[slots] = rope(k)``,
    ``v_buf[slots] = v``, every other pool row untouched (scattered, unordered slots). With
    ``qk_norm``, a per-head RMSNorm of q and k (weights away from 1) comes first, as in Qwen3.
    ``k`` stays as it was, or with ``k_inplace`` holds exactly what its slots got."""
    from phloem.runtime.layers import fused_triton
    from phloem.runtime.layers.rmsnorm import rms_norm_ref
    from phloem.runtime.layers.rotary import RotaryEmbedding, rope_ref

    gen = torch.Generator(device=device).manual_seed(seed)
    t, hq, hk, dim = shape
    rotary = RotaryEmbedding(dim, 8192, 10000.0).to(device)
    positions = torch.randint(0, 8192, (t,), generator=gen, device=device)
    cos_sin = rotary.cos_sin(positions)
    qkv = torch.randn((t, (hq + 2 * hk) * dim), generator=gen, device=device).to(dtype)
    q, k, v = qkv.split([hq * dim, hk * dim, hk * dim], dim=-1)
    q, k, v = q.view(t, hq, dim), k.view(t, hk, dim), v.view(t, hk, dim)
    num_slots = 3 * t + 5
    slots = torch.randperm(num_slots, generator=gen, device=device)[:t]
    k_buf = torch.randn((num_slots, hk, dim), generator=gen, device=device).to(dtype)
    v_buf = torch.randn((num_slots, hk, dim), generator=gen, device=device).to(dtype)
    norm = None
    ref_in_q, ref_in_k = q.clone(), k.clone()
    if qk_norm:
        eps = 1e-6
        q_w = (1 + 0.3 * torch.randn(dim, generator=gen, device=device)).to(dtype)
        k_w = (1 + 0.3 * torch.randn(dim, generator=gen, device=device)).to(dtype)
        norm = (q_w, k_w, eps)
        ref_in_q, ref_in_k = rms_norm_ref(ref_in_q, q_w, eps), rms_norm_ref(ref_in_k, k_w, eps)
    ref_q, ref_k = rope_ref(ref_in_q, ref_in_k, cos_sin)
    ref_kb, ref_vb = k_buf.clone(), v_buf.clone()
    ref_kb[slots], ref_vb[slots] = ref_k, v
    k_before = k.clone()
    v_before = v.clone()
    out_q = fused_triton.rope_store_(
        q, k, v, *cos_sin, k_buf, v_buf, slots, qk_norm=norm, k_inplace=k_inplace
    )
    assert out_q.data_ptr() == q.data_ptr(), "rope_store_ did not rotate q in place"
    if k_inplace:
        assert torch.equal(k, k_buf[slots]), "k rotated in place differs from what its slots got"
    else:
        assert torch.equal(k, k_before), "rope_store_ changed k"
    assert torch.equal(v, v_before), "rope_store_ changed v"
    assert torch.equal(v_buf, ref_vb), "v rows differ from a plain scatter of v"
    untouched = torch.ones(num_slots, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert torch.equal(k_buf[untouched], ref_kb[untouched]), "rope_store_ wrote outside its slots"
    return max(check_close("rope_store q", q, ref_q), check_close("rope_store k", k_buf[slots], ref_k))


def check_rope_store_qk_norm(
    shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, seed: int
) -> float:
    return check_rope_store(shape, dtype, device, seed, qk_norm=True)


def check_rope_store_k_inplace(
    shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, seed: int
) -> float:
    return check_rope_store(shape, dtype, device, seed, qk_norm=True, k_inplace=True)


def check_rope_store_fp8(
    shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, seed: int, scales=(0.05, 0.02)
) -> float:
    """``rope_store_`` into an fp8 pool: q rotated exactly as with a ``dtype`` pool, and every
    written K/V byte the one ``KVPool.set_kv`` stores for the rotated k and v of the ``dtype`` pool
    (with its per-tensor scales; values past +-448 after scaling saturate); other rows untouched.
    Qwen3's per-head norms on (they change the rounding the quantization starts from)."""
    from phloem.runtime.cache.kv_pool import KVPool
    from phloem.runtime.layers import fused_triton
    from phloem.runtime.layers.rotary import RotaryEmbedding

    gen = torch.Generator(device=device).manual_seed(seed)
    t, hq, hk, dim = shape
    k_scale, v_scale = scales
    rotary = RotaryEmbedding(dim, 8192, 10000.0).to(device)
    cos_sin = rotary.cos_sin(torch.randint(0, 8192, (t,), generator=gen, device=device))
    q = torch.randn((t, hq, dim), generator=gen, device=device).to(dtype)
    k = (torch.randn((t, hk, dim), generator=gen, device=device) * 4).to(dtype)
    v = (torch.randn((t, hk, dim), generator=gen, device=device) * 4).to(dtype)
    v[0, 0, :4] = torch.tensor([30.0, -30.0, 1e-4, 0.0])  # saturating and tiny values
    norm = ((1 + 0.3 * torch.randn(dim, generator=gen, device=device)).to(dtype),) * 2 + (1e-6,)
    num_slots = 3 * t + 5
    slots = torch.randperm(num_slots, generator=gen, device=device)[:t]
    wide = torch.zeros((num_slots, hk, dim), dtype=dtype, device=device)
    q16 = q.clone()
    fused_triton.rope_store_(q16, k, v, *cos_sin, wide, wide.clone(), slots, qk_norm=norm)
    k16 = wide[slots]
    pool = KVPool(1, num_slots, hk, dim, FP8, device, k_scales=[k_scale], v_scales=[v_scale])
    ref_k, ref_v = (b.clone() for b in pool.get_kv(0))
    ref_pool = KVPool(1, num_slots, hk, dim, FP8, device, k_scales=[k_scale], v_scales=[v_scale])
    ref_pool.set_kv(0, slots, k16, v)
    k_buf, v_buf = pool.get_kv(0)
    q8 = q.clone()
    fused_triton.rope_store_(
        q8, k, v, *cos_sin, k_buf, v_buf, slots, qk_norm=norm, k_scale=k_scale, v_scale=v_scale
    )
    assert torch.equal(q8, q16), "q differs between the fp8 and the 16-bit pool"
    want_k, want_v = ref_pool.get_kv(0)
    assert torch.equal(k_buf.view(torch.uint8), want_k.view(torch.uint8)), "fp8 K bytes differ from set_kv's"
    assert torch.equal(v_buf.view(torch.uint8), want_v.view(torch.uint8)), "fp8 V bytes differ from set_kv's"
    untouched = torch.ones(num_slots, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert torch.equal(k_buf[untouched].view(torch.uint8), ref_k[untouched].view(torch.uint8))
    assert torch.equal(v_buf[untouched].view(torch.uint8), ref_v[untouched].view(torch.uint8))
    return 0.0


def run_small(dtypes: dict[str, torch.dtype], device: str = "cpu") -> int:
    """Every small case in ``dtypes``; prints one line per case, returns the number of failures."""
    cases = [
        *(("rmsnorm", check_rmsnorm, s) for s in SMALL_NORM_SHAPES),
        *(("silu_and_mul", check_silu_and_mul, s) for s in SMALL_SILU_SHAPES),
        *(("rope", check_rope, s) for s in SMALL_ROPE_SHAPES),
        *(("rope_store", check_rope_store, s) for s in SMALL_ROPE_SHAPES),
        *(("rope_store+qk_norm", check_rope_store_qk_norm, s) for s in SMALL_ROPE_SHAPES),
        *(("rope_store+qk_norm+k_inplace", check_rope_store_k_inplace, s) for s in SMALL_ROPE_SHAPES),
        # not "rope_store fp8": the interpreter (Triton 3.6) converts float32 to e4m3 wrongly
        # (1.99 -> 1.0, -126.25 -> -64), so that case runs compiled on CUDA only
    ]
    failures = 0
    for name, check, shape in cases:
        for dtype_name, dtype in dtypes.items():
            try:
                err = check(shape, dtype, device, 3)  # type: ignore[operator]
                print(f"ok   {name} {shape} {dtype_name} rel_err={err:.2e}")
            except AssertionError as exc:
                failures += 1
                print(f"FAIL {name} {shape} {dtype_name}: {exc}")
    return failures


def main() -> int:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' module imports triton
    return 1 if run_small(DTYPES, "cpu") else 0


if __name__ == "__main__":
    sys.exit(main())
