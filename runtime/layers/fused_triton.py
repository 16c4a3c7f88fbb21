"""Fused Triton kernels for the CUDA decoder layer: residual add + RMSNorm, SiLU x mul, RoPE.

Each kernel does in one launch what the torch reference next to its layer does in several
(``rmsnorm.py``, ``activation.py``, ``rotary.py``): at decode sizes the time goes to kernel count,
not to bytes. The arithmetic is the reference's, in float32, rounded to the tensor dtype where the
reference rounds, so the two agree to rounding. What one call computes, as plain loops::

    add_rmsnorm (rmsnorm: the same without the residual; rows = every leading index):
        for t in rows:
            r = (x[t] + residual[t]).to(dtype)                  # new residual, stored
            normed[t] = (r * rsqrt(mean(r^2) + eps) * w).to(dtype)

    silu_and_mul (gate_up = [gate | up], [T, 2I]):
        for t, i in rows x range(I):
            s = silu(gate[t, i]).to(dtype)
            out[t, i] = (s * up[t, i]).to(dtype)

    rope_ (in place; neox "rotate half" layout, D = head_dim, c = D // 2):
        for t, h in tokens x (q heads, then k heads):
            (rope_store_ with qk_norm first: x[t, h] = rmsnorm(x[t, h], w_q or w_k).to(dtype))
            x1, x2 = x[t, h, :c], x[t, h, c:]
            x[t, h] = cat(x1 * cos[t] - x2 * sin[t], x2 * cos[t] + x1 * sin[t]).to(dtype)

Grids depend on shapes only and no launch reads device data on the host, so all three can be
captured in a CUDA graph. Inputs must have a contiguous last axis (other strides are free). On
Hopper they launch with programmatic dependent launch (:mod:`phloem.runtime.layers.pdl`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from phloem.runtime.layers.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait

__all__ = ["add_rmsnorm", "check_kv_write", "rmsnorm", "rope_", "rope_store_", "silu_and_mul", "to_fp8"]


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, out_ptr, res_out_ptr, w_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # grid: (rows,)
    pdl_trigger(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (h * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl_trigger(PDL)
    pdl_wait(PDL)
    # grid: (rows, cdiv(n_cols, BLOCK)); n_cols = I, the up half starts at column I
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    base = gate_up_ptr + row * stride_in
    gate = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # rounded, as torch's silu
    tl.store(out_ptr + row * stride_out + offs, (silu * up).to(dtype), mask=mask)


@triton.jit
def _rotate_heads(base, stride_h, dst, stride_dst_h, cos, sin, offs_d, d_mask, N_HEADS: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, w_ptr, eps, HAS_NORM: tl.constexpr,
                  scale, QUANT: tl.constexpr):  # fmt: skip
    """Rotate heads ``0 .. N_HEADS`` of one token from ``base`` into ``dst`` (the same pointer:
    in place); ``cos``/``sin``: ``[1, BLOCK_HALF]``. With ``HAS_NORM`` each head is first
    RMS-normalized with weight ``w_ptr`` ``[2 * HALF]`` and rounded to the dtype, as the separate
    norm would store it. With ``QUANT`` ``dst`` is fp8: the rotated values are rounded to the
    activation dtype first, then stored as :func:`to_fp8` of them (``KVPool.set_kv``'s rounding)."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < N_HEADS)[:, None] & d_mask[None, :]
    lo = base + offs_h[:, None] * stride_h + offs_d[None, :]  # [BLOCK_H, BLOCK_HALF]
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = base.dtype.element_ty  # the activation dtype (dst's unless QUANT)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        x1 = (x1 * rstd * w1).to(dtype).to(tl.float32)
        x2 = (x2 * rstd * w2).to(dtype).to(tl.float32)
    out = dst + offs_h[:, None] * stride_dst_h + offs_d[None, :]
    y1 = (x1 * cos - x2 * sin).to(dtype)
    y2 = (x2 * cos + x1 * sin).to(dtype)
    if QUANT:
        y1 = to_fp8(y1, scale, dst.dtype.element_ty)
        y2 = to_fp8(y2, scale, dst.dtype.element_ty)
    tl.store(out, y1, mask=mask)
    tl.store(out + HALF, y2, mask=mask)


@triton.jit
def to_fp8(x, scale, fp8_dtype: tl.constexpr):
    """``fp8(clamp(x / scale, -448, 448))`` with a correctly rounded division: the rounding of
    ``KVPool._quantize`` (torch divides exactly and converts to nearest-even)."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    return tl.minimum(tl.maximum(y, -448.0), 448.0).to(fp8_dtype)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    # grid: (tokens,); one program rotates every q and k head of its token
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + t * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    q = q_ptr + t * stride_qt
    k = k_ptr + t * stride_kt
    _rotate_heads(q, stride_qh, q, stride_qh, cos, sin, offs_d, d_mask, NUM_Q_HEADS, HALF, BLOCK_HQ,
                  q, 0.0, False, 1.0, False)  # fmt: skip
    _rotate_heads(k, stride_kh, k, stride_kh, cos, sin, offs_d, d_mask, NUM_K_HEADS, HALF, BLOCK_HK,
                  k, 0.0, False, 1.0, False)  # fmt: skip


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_buf_ptr, v_buf_ptr, slots_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_kbt, stride_kbh, stride_vbt, stride_vbh, qn_ptr, kn_ptr, eps, k_scale, v_scale,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr, QUANT: tl.constexpr, K_INPLACE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # grid: (tokens,); q (normalized per head with HAS_NORM, then) rotated in place, k likewise
    # into the token's KV slot (and, with K_INPLACE, in place too), v copied there (QUANT: an fp8
    # pool, scaled by k_scale / v_scale)
    pdl_trigger(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + t * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    q = q_ptr + t * stride_qt
    _rotate_heads(q, stride_qh, q, stride_qh, cos, sin, offs_d, d_mask, NUM_Q_HEADS, HALF, BLOCK_HQ,
                  qn_ptr, eps, HAS_NORM, 1.0, False)  # fmt: skip
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, k_buf_ptr + slot * stride_kbt, stride_kbh,
                  cos, sin, offs_d, d_mask, NUM_K_HEADS, HALF, BLOCK_HK, kn_ptr, eps, HAS_NORM,
                  k_scale, QUANT)  # fmt: skip
    if K_INPLACE:  # after the slot write, which read k as it came in
        k = k_ptr + t * stride_kt
        _rotate_heads(k, stride_kh, k, stride_kh, cos, sin, offs_d, d_mask, NUM_K_HEADS, HALF, BLOCK_HK,
                      kn_ptr, eps, HAS_NORM, 1.0, False)  # fmt: skip
    offs_h = tl.arange(0, BLOCK_HK)
    offs_v = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_K_HEADS)[:, None] & (offs_v < HEAD_DIM)[None, :]
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :], mask=mask, other=0.0)
    dst = v_buf_ptr + slot * stride_vbt + offs_h[:, None] * stride_vbh + offs_v[None, :]
    if QUANT:
        v = to_fp8(v, v_scale, v_buf_ptr.dtype.element_ty)
    tl.store(dst, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


# ---- launchers --------------------------------------------------------------------------------
SILU_BLOCK = 1024  # columns per program of the SiLU kernel (16-byte accesses for 16-bit dtypes)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with a contiguous last axis (a view when the strides allow)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _launch_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} for rows of {n}")
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else None
    if x2.shape[0] == 0:
        return out, res_out
    r2 = _rows(residual) if residual is not None else x2
    block = triton.next_power_of_2(n)
    pdl = pdl_enabled(x.device)
    _rmsnorm_kernel[(x2.shape[0],)](
        x2, r2, out, res_out if res_out is not None else out, weight,
        x2.stride(0), r2.stride(0), n, n,
        n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, PDL=pdl, num_warps=_norm_warps(block),
        **launch_kwargs(pdl),
    )  # fmt: skip
    return out, res_out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis of ``x`` ``[..., N]`` with ``weight`` ``[N]``; a new tensor of
    ``x``'s shape and dtype (float32 arithmetic)."""
    return _launch_norm(x, None, weight, eps)[0]


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (rounded to the dtype), then RMSNorm of it: ``(normed, residual)``.

    Both results are new tensors of ``x``'s shape and dtype; the inputs are left as they are.

    Raises
    ------
    ValueError
        If ``x`` and ``residual`` differ in shape or dtype.
    """
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} {residual.dtype} differ"
        )
    out, res_out = _launch_norm(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused ``[..., 2 * I]`` projection: ``silu(gate) * up`` -> new ``[..., I]``."""
    width = gate_up.shape[-1] // 2
    x2 = _rows(gate_up)
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    if x2.shape[0] and width:
        block = min(SILU_BLOCK, triton.next_power_of_2(width))
        grid = (x2.shape[0], triton.cdiv(width, block))
        pdl = pdl_enabled(gate_up.device)
        _silu_and_mul_kernel[grid](
            x2, out, x2.stride(0), width, width, BLOCK=block, PDL=pdl, num_warps=4, **launch_kwargs(pdl)
        )
    return out


def rope_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` in place; returns them.

    ``cos``, ``sin``: the tables of the tokens' positions, ``[T, D/2]`` or ``[T, 1, D/2]`` (any
    float dtype; read as float32). ``q`` and ``k`` may be strided views (e.g. of one fused qkv
    projection) as long as each head's ``D`` values are contiguous.
    """
    t, num_q, dim = q.shape
    num_k = k.shape[1]
    half = dim // 2
    if k.shape[0] != t or k.shape[2] != dim or dim % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: need [T, H, D] with D even")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope_ needs a contiguous last axis on q, k, cos and sin")
    if cos.shape[0] != t or cos.shape[-1] != half or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not match {t} tokens of head_dim {dim}")
    if t == 0:
        return q, k
    _rope_kernel[(t,)](
        q, k, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=num_q, NUM_K_HEADS=num_k, HALF=half,
        BLOCK_HQ=triton.next_power_of_2(num_q), BLOCK_HK=triton.next_power_of_2(num_k),
        BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
    )  # fmt: skip
    return q, k


def check_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    k_scale: float,
    v_scale: float,
) -> None:
    """Raise ``ValueError`` unless ``q``, ``k``, ``v`` ``[T, H, D]`` (``D`` even), their RoPE
    tables ``[T, 1, D/2]``, ``slots`` ``[T]`` and the norm weights fit a fused rotate-and-store into
    the pool ``k_buf``/``v_buf`` (of ``k``'s dtype, or fp8 with positive scales), every tensor with a
    contiguous last axis. Shared by :func:`rope_store_` and the decode kernel that does the same
    (``triton_kernels.NewTokenKV``)."""
    t, _, dim = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != dim or dim % 2:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need [T, H, D], D even"
        )
    quant = k_buf.dtype == torch.float8_e4m3fn
    if quant and (v_buf.dtype != k_buf.dtype or k_scale <= 0 or v_scale <= 0):
        raise ValueError(
            f"an fp8 pool needs fp8 K and V buffers and positive scales, got {k_scale}, {v_scale}"
        )
    if (not quant and (k_buf.dtype != k.dtype or v_buf.dtype != v.dtype)) or k_buf.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"pool {tuple(k_buf.shape)} {k_buf.dtype} does not hold k {tuple(k.shape)} {k.dtype}"
        )
    if any(x.stride(-1) != 1 for x in (q, k, v, cos, sin, k_buf, v_buf)):
        raise ValueError("a fused rotate-and-store needs a contiguous last axis on every tensor")
    if cos.shape[0] != t or cos.shape[-1] != dim // 2 or sin.shape != cos.shape or slots.shape != (t,):
        raise ValueError(f"cos/sin {tuple(cos.shape)} or slots {tuple(slots.shape)} do not match {t} tokens")
    if qk_norm is not None and any(w.shape != (dim,) or w.stride(-1) != 1 for w in qk_norm[:2]):
        raise ValueError(f"q/k norm weights must be contiguous [{dim}]")


def rope_store_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_inplace: bool = False,
) -> torch.Tensor:
    """:func:`rope_` on ``q`` (in place, returned) with the K/V write of the layer folded in:
    ``k_buf[slots] = rope(k)`` and ``v_buf[slots] = v``, one launch instead of three (``k`` itself
    is left as it is unless ``k_inplace``: then it is rotated in place too, in the activation
    dtype, for an attention kernel that reads the new keys from ``k``). ``k_buf``, ``v_buf``:
    ``[num_slots, Hk, D]`` of ``k``'s dtype, or an fp8 pool (``torch.float8_e4m3fn``) with its
    per-tensor ``k_scale``/``v_scale``, written exactly as ``KVPool.set_kv`` writes the rotated k
    and v; ``slots``: ``[T]`` int64.

    ``qk_norm``: ``(q_weight, k_weight, eps)``, each weight ``[D]``: a per-head RMSNorm of q and k
    before the rotation (Qwen3), so ``q = rope(rmsnorm(q))`` and ``k_buf[slots] = rope(rmsnorm(k))``;
    two norm launches and the copies of the strided q and k they would need are folded in too."""
    t, num_q, dim = q.shape
    num_k = k.shape[1]
    half = dim // 2
    check_kv_write(q, k, v, cos, sin, k_buf, v_buf, slots, qk_norm, k_scale, v_scale)
    quant = k_buf.dtype == torch.float8_e4m3fn
    if t == 0:
        return q
    q_w, k_w, eps = qk_norm if qk_norm is not None else (q, q, 0.0)  # unused pointers without a norm
    pdl = pdl_enabled(q.device)
    _rope_store_kernel[(t,)](
        q, k, v, cos, sin, k_buf, v_buf, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), q_w, k_w, eps,
        float(k_scale), float(v_scale),
        NUM_Q_HEADS=num_q, NUM_K_HEADS=num_k, HALF=half, HEAD_DIM=dim,
        BLOCK_HQ=triton.next_power_of_2(num_q), BLOCK_HK=triton.next_power_of_2(num_k),
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(dim),
        HAS_NORM=qk_norm is not None, QUANT=quant, K_INPLACE=k_inplace, PDL=pdl, num_warps=4,
        **launch_kwargs(pdl),
    )  # fmt: skip
    return q
