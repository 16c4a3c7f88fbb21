"""Few-row decode projections with the RMSNorm before them (and SwiGLU after) in the same kernel.

At batch 1 a decoder layer of a small model is ten short launches; each costs a few microseconds
whatever it computes, so the step time of a small model is mostly launch count (a few hundred
kernels a step). This kernel folds two of them into the projection that follows:

- ``input_layernorm`` (its residual add included) into the qkv projection;
- ``post_attention_layernorm`` into the MLP's gate/up projection, and SiLU x mul into its output.

The norm is a scalar per row, so it factors out of the dot product and one pass over ``W`` does
everything (``h = x + residual``, ``g`` the norm weight, ``r = rsqrt(mean(h^2) + eps)``)::

    for n in range(N):                       # one program per BLOCK_N outputs, as skinny_gemm
        acc[n] = sum_k W[n, k] * h[k] * g[k]   # float32; the program also sums h[k]^2
        y[n] = acc[n] * r (+ b[n])
    GLU: y[n] = silu(acc[n] * r) * (acc[n + I] * r)   # gate row n, up row n + I, I = N / 2

Every program reads all of ``h`` (it needs it for the dot anyway); program 0 also writes ``h``
out, the residual stream the next norm adds to. Rounding differs from the unfused layers in one
place: the normalized row and the gate/up values are not rounded to 16 bits before use (the
oracle is the unfused torch path: ``add_rms_norm_ref``, ``F.linear``, ``silu_and_mul_ref``).

Two to :data:`MAX_ROWS` rows (small-batch decode, a speculative verify pass, the draft head) take
a second kernel built on ``tl.dot``, whose operands must be 16-bit. A program takes 16 rows and
``BLOCK_N`` columns (more rows: more programs, each reading its weight tile, from L2 after the
first). It sums ``h^2`` over the whole of its rows (``h`` is small and stays in L2), normalizes
them exactly as the separate norm kernel does (``h * r * g`` rounded to the activation dtype) and
multiplies them by its weight rows. So the projection sees the separate norm's values; only the
gate/up values reach SiLU x mul unrounded. It replaces two or three launches (norm, library GEMM,
SiLU x mul) by one where :func:`rows_fusion_wins` says so.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from phloem.runtime import switches
from phloem.runtime.layers.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait
from phloem.runtime.layers.skinny_gemm import SkinnyConfig, pick_config

__all__ = [
    "MAX_ROWS",
    "ROWS_FUSION_MAX_ELEMENTS",
    "rows_fusion_max_k",
    "rows_fusion_max_rows",
    "norm_linear_rows",
    "row_config",
    "rows_fusion_wins",
]

# Triton's CPU interpreter multiplies bfloat16 dot operands wrongly (as in skinny_gemm): there the
# few-row kernel feeds the dot float32 copies of its 16-bit tiles (read on first launch).
@functools.cache
def _interpreted() -> bool:
    return switches.TRITON_INTERPRET.flag()


MAX_ROWS = 256  # rows one call takes; a program takes 16 of them (the smallest tl.dot tile)
_ROWS_PER_PROGRAM = 16


@triton.jit
def _norm_row_chunk(
    k0, w_a, w_b, acc_a, acc_b, sq, x_ptr, res_ptr, h_ptr, g_ptr, pid, offs_k, K,
    HAS_RES: tl.constexpr, GLU: tl.constexpr,
):  # fmt: skip
    """One BLOCK_K chunk: ``h`` (and its store, program 0), the sum of squares, the dots."""
    kk = k0 + offs_k
    k_mask = kk < K
    h = tl.load(x_ptr + kk, mask=k_mask, other=0.0)
    if HAS_RES:  # x + residual, rounded to the activation dtype as a plain add rounds it
        h = (h.to(tl.float32) + tl.load(res_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)).to(
            h_ptr.dtype.element_ty
        )
        if pid == 0:
            tl.store(h_ptr + kk, h, mask=k_mask)
    hf = h.to(tl.float32)
    sq += hf * hf
    hg = hf * tl.load(g_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
    acc_a += tl.sum(w_a.to(tl.float32) * hg[None, :], axis=1)
    if GLU:
        acc_b += tl.sum(w_b.to(tl.float32) * hg[None, :], axis=1)
    return acc_a, acc_b, sq


@triton.jit
def _norm_row_kernel(
    x_ptr, res_ptr, h_ptr, g_ptr, w_ptr, b_ptr, y_ptr,
    N, K, HALF, stride_wn, eps,
    HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(N, BLOCK_N),) with N the output width (I for GLU)
    pdl_trigger(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    rows_a = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    rows_b = w_ptr + (offs_n + HALF).to(tl.int64)[:, None] * stride_wn  # up rows (GLU only)
    acc_a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    # the first chunk of W is read before waiting on the previous kernel (PDL): no kernel of the
    # step writes weights
    w_mask = n_mask[:, None] & (offs_k < K)[None, :]
    w_a = tl.load(rows_a + offs_k[None, :], mask=w_mask, other=0.0)
    w_b = w_a
    if GLU:
        w_b = tl.load(rows_b + offs_k[None, :], mask=w_mask, other=0.0)
    pdl_wait(PDL)
    acc_a, acc_b, sq = _norm_row_chunk(
        0, w_a, w_b, acc_a, acc_b, sq, x_ptr, res_ptr, h_ptr, g_ptr, pid, offs_k, K, HAS_RES, GLU
    )
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_mask = n_mask[:, None] & (k0 + offs_k < K)[None, :]
        w_a = tl.load(rows_a + (k0 + offs_k)[None, :], mask=w_mask, other=0.0)
        w_b = w_a
        if GLU:
            w_b = tl.load(rows_b + (k0 + offs_k)[None, :], mask=w_mask, other=0.0)
        acc_a, acc_b, sq = _norm_row_chunk(
            k0, w_a, w_b, acc_a, acc_b, sq, x_ptr, res_ptr, h_ptr, g_ptr, pid, offs_k, K, HAS_RES, GLU
        )
    r = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)
    y = acc_a * r
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if GLU:
        y = y * tl.sigmoid(y) * (acc_b * r)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _rows_h(x_rows, r_rows, h_ptr, kk, hm, K, offs_m, pid, HAS_RES: tl.constexpr, dtype: tl.constexpr):
    """One chunk of ``h = x + residual`` (rounded as a plain add rounds it); program 0 stores it."""
    h = tl.load(x_rows + kk[None, :], mask=hm, other=0.0)
    if HAS_RES:
        h = (h.to(tl.float32) + tl.load(r_rows + kk[None, :], mask=hm, other=0.0).to(tl.float32)).to(dtype)
        if pid == 0:
            tl.store(h_ptr + offs_m[:, None] * K + kk[None, :], h, mask=hm)
    return h


@triton.jit
def _rows_dot(acc, hn, w, UPCAST: tl.constexpr):
    if UPCAST:  # exact: 16-bit values and their products fit float32
        return tl.dot(hn.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
    return tl.dot(hn, tl.trans(w), acc)


@triton.jit
def _norm_rows_kernel(
    x_ptr, res_ptr, h_ptr, g_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, HALF, stride_xm, stride_rm, stride_ym, stride_wn, eps,
    HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr, UPCAST: tl.constexpr,
    SINGLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)); h is written contiguous ([M, K]) by the
    # programs of the first column block
    pdl_trigger(PDL)
    pid = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    r_rows = res_ptr + offs_m[:, None] * stride_rm
    rows_a = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    rows_b = w_ptr + (offs_n + HALF).to(tl.int64)[:, None] * stride_wn  # up rows (GLU only)
    dtype = w_ptr.dtype.element_ty
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SINGLE:  # K fits one chunk: the weight tile is read before the PDL wait, the rows once after
        k_mask = offs_k < K
        wm = n_mask[:, None] & k_mask[None, :]
        w_a = tl.load(rows_a + offs_k[None, :], mask=wm, other=0.0)  # no kernel of the step writes weights
        w_b = w_a
        if GLU:
            w_b = tl.load(rows_b + offs_k[None, :], mask=wm, other=0.0)
        pdl_wait(PDL)
        hf = _rows_h(x_rows, r_rows, h_ptr, offs_k, m_mask[:, None] & k_mask[None, :], K, offs_m, pid,
                     HAS_RES, dtype).to(tl.float32)  # fmt: skip
        r = tl.rsqrt(tl.sum(hf * hf, axis=1) / K + eps)
        g = tl.load(g_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        hn = (hf * r[:, None] * g[None, :]).to(dtype)  # rounded as the norm kernel rounds it
        acc_a = _rows_dot(acc_a, hn, w_a, UPCAST)
        if GLU:
            acc_b = _rows_dot(acc_b, hn, w_b, UPCAST)
    else:
        pdl_wait(PDL)
        # pass 1: each row's sum of squares of h
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            hf = _rows_h(x_rows, r_rows, h_ptr, kk, m_mask[:, None] & (kk < K)[None, :], K, offs_m, pid,
                         HAS_RES, dtype).to(tl.float32)  # fmt: skip
            sq += tl.sum(hf * hf, axis=1)
        r = tl.rsqrt(sq / K + eps)
        # pass 2: the normalized rows (h again, from L2), rounded as the norm kernel rounds them
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < K
            hm = m_mask[:, None] & k_mask[None, :]
            h = tl.load(x_rows + kk[None, :], mask=hm, other=0.0)
            if HAS_RES:
                h = (h.to(tl.float32) + tl.load(r_rows + kk[None, :], mask=hm, other=0.0).to(tl.float32)).to(
                    dtype
                )
            g = tl.load(g_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            hn = (h.to(tl.float32) * r[:, None] * g[None, :]).to(dtype)
            wm = n_mask[:, None] & k_mask[None, :]
            acc_a = _rows_dot(acc_a, hn, tl.load(rows_a + kk[None, :], mask=wm, other=0.0), UPCAST)
            if GLU:
                acc_b = _rows_dot(acc_b, hn, tl.load(rows_b + kk[None, :], mask=wm, other=0.0), UPCAST)
    y = acc_a
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GLU:
        y = y * tl.sigmoid(y) * acc_b
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def row_config(n_rows: int, k: int, *, glu: bool, rows: int = 1) -> SkinnyConfig:
    """Block sizes for an ``[n_rows, K]`` stacked weight and ``rows`` rows of input.

    One row (chosen over the shapes of SmolLM2-135M, Qwen3-0.6B and Llama-3-8B): four warps
    everywhere; gate/up: two columns per
    program (four weight rows with their up rows), K in chunks of 1,024; qkv: the plain kernel's
    columns, K in chunks of 512 from K = 1,024 (one chunk below that). Several rows: the skinny
    kernel's dot-path columns for the output width; K up to 1,024 in one chunk (the weight tile is
    then read before the PDL wait; eight warps), longer K in chunks of 128 (two passes over the
    rows)."""
    if rows > 1:
        n = n_rows // 2 if glu else n_rows
        if k <= 1024:  # one chunk: K rounded up to a power of two
            return SkinnyConfig(16 if n <= 1024 else 32, triton.next_power_of_2(k), 8, 3)
        return SkinnyConfig(16 if n <= 1024 else 32, 128, 4, 3)
    if glu:
        return SkinnyConfig(2, 1024, 4, 3)
    return SkinnyConfig(pick_config(n_rows, k, 1).block_n, 512 if k >= 1024 else 1024, 4, 3)


# 2-16 rows fold only on small weights whose rows fit one chunk of K of at most 768 (SmolLM2-135M
# and its EAGLE head), where the separate kernels cost their launches rather than their bytes. At
# K = 1,024 (Qwen3-0.6B) the kernel is faster alone but slows the whole decode step; on large
# weights (Llama-3-8B) and past 16 rows the library GEMM after a separate norm is faster. The
# row and K limits are switches (``PHLOEM_ROW_FUSION_MAX_ROWS``, ``PHLOEM_ROW_FUSION_MAX_K``).
ROWS_FUSION_MAX_ELEMENTS = 1 << 24


@functools.cache
def rows_fusion_max_k() -> int:
    """Longest row that folds for 2+ rows (``PHLOEM_ROW_FUSION_MAX_K``, read on first call)."""
    return switches.ROW_FUSION_MAX_K.number()


@functools.cache
def rows_fusion_max_rows() -> int:
    """Most rows that fold (``PHLOEM_ROW_FUSION_MAX_ROWS``, 1..MAX_ROWS, read on first call)."""
    return max(1, min(MAX_ROWS, switches.ROW_FUSION_MAX_ROWS.number()))


def rows_fusion_wins(n_rows: int, k: int, rows: int) -> bool:
    """Whether the fused kernel should replace the separate norm and projection for ``rows`` rows
    of an ``[n_rows, K]`` weight: always for one row; for 2-16 rows on small weights with
    ``K <= 768``, where the separate kernels cost their launches rather than their bytes."""
    if rows == 1:
        return True
    return (
        1 < rows <= rows_fusion_max_rows() and k <= rows_fusion_max_k() and n_rows * k <= ROWS_FUSION_MAX_ELEMENTS
    )


def norm_linear_rows(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    glu: bool = False,
    config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.linear(rms_norm(x + residual), weight, bias)`` for ``x`` of 1 to :data:`MAX_ROWS` rows
    ``[M, K]``, and the sum ``x + residual`` (``x`` itself when ``residual`` is None). With
    ``glu``, ``weight`` stacks gate and up (``[2I, K]``) and the first result is
    ``silu(gate) * up`` ``[M, I]`` (no bias).

    Raises
    ------
    ValueError
        No rows or more than :data:`MAX_ROWS`, mismatched widths or dtypes, a non-contiguous
        weight row, or ``glu`` with a bias or an odd number of weight rows.
    """
    n_rows, k = weight.shape
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != k:
        raise ValueError(f"x must be [1..{MAX_ROWS}, {k}], got {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if weight.dtype != x.dtype or weight.stride(-1) != 1 or norm_weight.shape != (k,):
        raise ValueError("weight must share x's dtype and have a contiguous last axis; norm weight [K]")
    if glu and (bias is not None or n_rows % 2):
        raise ValueError("glu takes a stacked [2I, K] weight and no bias")
    m = x.shape[0]
    n = n_rows // 2 if glu else n_rows
    x = x.contiguous()
    res = residual.contiguous() if residual is not None else x
    h = torch.empty_like(x) if residual is not None else x
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = config or row_config(n_rows, k, glu=glu, rows=m)
    pdl = pdl_enabled(x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, _ROWS_PER_PROGRAM))
    common = dict(HAS_RES=residual is not None, HAS_BIAS=bias is not None, GLU=glu,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=pdl, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, **launch_kwargs(pdl))  # fmt: skip
    b = bias if bias is not None else weight
    if m == 1:
        _norm_row_kernel[grid](
            x, res, h, norm_weight, weight, b, y, n, k, n, weight.stride(0), float(eps), **common
        )
    else:
        _norm_rows_kernel[grid](
            x, res, h, norm_weight, weight, b, y,
            m, n, k, n, x.stride(0), res.stride(0), y.stride(0), weight.stride(0), float(eps),
            UPCAST=_interpreted(), SINGLE=cfg.block_k >= k, BLOCK_M=_ROWS_PER_PROGRAM, **common,
        )  # fmt: skip
    return y, h
