"""One-row decode projections with the RMSNorm before them (and SwiGLU after) in the same kernel.

At batch 1 a decoder layer of a small model is ten short launches; each costs a few microseconds
whatever it computes, so the step time is mostly launch count (SmolLM2-135M on an H200: ~300
kernels, 0.65 ms). This kernel folds two of them into the projection that follows:

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from phloem.runtime.layers.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait
from phloem.runtime.layers.skinny_gemm import SkinnyConfig, pick_config

__all__ = ["norm_linear_row", "row_config"]


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


def row_config(n_rows: int, k: int, *, glu: bool) -> SkinnyConfig:
    """Block sizes for an ``[n_rows, K]`` stacked weight, from a sweep on an H200 at one row
    (``benchmarks/gpu/row_fused_bench.py --sweep``; the shapes of SmolLM2-135M, Qwen3-0.6B and
    Llama-3-8B). Four warps everywhere; gate/up: two columns per program (four weight rows with
    their up rows), K in chunks of 1,024; qkv: the plain kernel's columns, K in chunks of 512 from
    K = 1,024 (one chunk below that)."""
    if glu:
        return SkinnyConfig(2, 1024, 4, 3)
    return SkinnyConfig(pick_config(n_rows, k, 1).block_n, 512 if k >= 1024 else 1024, 4, 3)


def norm_linear_row(
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
    """``F.linear(rms_norm(x + residual), weight, bias)`` for one row ``x`` ``[1, K]``, and the sum
    ``x + residual`` (``x`` itself when ``residual`` is None). With ``glu``, ``weight`` stacks gate
    and up (``[2I, K]``) and the first result is ``silu(gate) * up`` ``[1, I]`` (no bias).

    Raises
    ------
    ValueError
        Not exactly one row, mismatched widths or dtypes, a non-contiguous weight row, or ``glu``
        with a bias or an odd number of weight rows.
    """
    n_rows, k = weight.shape
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != k:
        raise ValueError(f"x must be [1, {k}], got {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if weight.dtype != x.dtype or weight.stride(-1) != 1 or norm_weight.shape != (k,):
        raise ValueError("weight must share x's dtype and have a contiguous last axis; norm weight [K]")
    if glu and (bias is not None or n_rows % 2):
        raise ValueError("glu takes a stacked [2I, K] weight and no bias")
    n = n_rows // 2 if glu else n_rows
    x = x.contiguous()
    h = torch.empty_like(x) if residual is not None else x
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    cfg = config or row_config(n_rows, k, glu=glu)
    block_n = cfg.block_n
    pdl = pdl_enabled(x.device)
    _norm_row_kernel[(triton.cdiv(n, block_n),)](
        x, residual.contiguous() if residual is not None else x, h, norm_weight, weight,
        bias if bias is not None else weight, y,
        n, k, n, weight.stride(0), float(eps),
        HAS_RES=residual is not None, HAS_BIAS=bias is not None, GLU=glu,
        BLOCK_N=block_n, BLOCK_K=cfg.block_k, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(pdl),
    )  # fmt: skip
    return y, h
