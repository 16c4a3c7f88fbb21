"""``y = x @ W.T (+ b)`` for a few rows of ``x``: the decode-time matmul, as one Triton kernel.

At decode a projection multiplies 1-16 rows by a weight of ``[N, K]``: the work is reading ``W``
once, and for a small model most of a step's device time is these launches. The vendor GEMM
library picks a tiled kernel meant for larger problems, which for a small model's projections
takes several times as long as reading the weight. This kernel gives
each program ``BLOCK_N`` output columns and streams their rows of ``W`` along ``K`` once, for all
rows of ``x`` together. What one call computes, as a plain loop::

    for n in range(N):                     # one program per BLOCK_N of these
        acc[:, n] = sum_k x[:, k] * W[n, k]  # float32 accumulation, k in BLOCK_K chunks
        y[:, n] = (acc[:, n] + b[n]).to(out_dtype)

One row (``M == 1``) reduces with multiply-adds; 2-16 rows use ``tl.dot`` with the rows padded to
16. The block sizes depend on ``(N, K)`` and the path only (:func:`pick_config`), so a row's result
does not depend on how many rows share a dot-path call. :func:`skinny_wins` says where the kernel
is faster than the GEMM library; the layers route there only. The grid depends on shapes only,
so the call can be captured in a CUDA graph.

On Hopper the kernel takes part in programmatic dependent launch (:mod:`phloem.runtime.layers.pdl`):
a one-row call reads its first chunk of ``W`` while the previous kernel of the step still runs.

The oracle is ``torch.nn.functional.linear`` (``tests/kernels/skinny_cases.py``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from phloem.runtime import switches
from phloem.runtime.layers.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait

__all__ = ["MAX_ROWS", "SkinnyConfig", "pick_config", "skinny_linear", "skinny_wins"]

MAX_ROWS = 16  # rows of x this kernel takes; more go to the GEMM library
_DTYPES = (torch.float16, torch.bfloat16)
# Triton's CPU interpreter multiplies bfloat16 dot operands wrongly; there the dot path works on
# float32 copies of the tiles (the compiled kernel keeps 16-bit operands). Read on first launch.
@functools.cache
def _interpreted() -> bool:
    return switches.TRITON_INTERPRET.flag()


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pick_config(n: int, k: int, rows: int) -> SkinnyConfig:
    """Block sizes for an ``[N, K]`` weight; ``rows`` only selects the one-row or the dot path.

    Chosen from a sweep over block sizes with the weights read from HBM, not L2 (the decode
    case). One row: many narrow programs, each reading its rows of
    ``W`` in one or a few long chunks, so that plenty of loads are in flight; wide weights (the
    LM head, Llama's MLP) take wider column blocks. Several rows: 16-32 columns per ``tl.dot``.
    """
    if rows == 1:
        if n >= 65536:
            return SkinnyConfig(32, 256 if k > 1024 else 128, 4, 3)
        if n >= 16384:
            return SkinnyConfig(16, 512 if k > 1024 else 128, 4, 3)
        return SkinnyConfig(4 if n * k <= 1 << 23 else 8, 1024, 8, 3)
    return SkinnyConfig(16 if n <= 1024 else 32, 128 if k <= 1024 else 512, 4, 3)


def skinny_wins(n: int, k: int, rows: int) -> bool:
    """Whether this kernel beat the GEMM library for ``rows`` rows of an ``[N, K]`` weight read
    from HBM: always for one row; for 2-16 rows only on weights at least as long as they are wide
    (attention output, MLP down), where the library's tiles leave most of the GPU idle."""
    return rows <= 1 or k >= n


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, ONE_ROW: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(N, BLOCK_N),); every program reads its BLOCK_N rows of W once
    pdl_trigger(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    if ONE_ROW:
        # the first chunk of W is read before waiting on the previous kernel (PDL): no kernel of
        # the step writes weights
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        pdl_wait(PDL)
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
        acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < K
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptr + kk, mask=k_mask, other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        pdl_wait(PDL)
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < K
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if UPCAST:  # exact: 16-bit values and their products fit tf32 / float32
                acc2 = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc2)
            else:
                acc2 = tl.dot(x, tl.trans(w), acc2)
        if HAS_BIAS:
            acc2 += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y, acc2.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of at most :data:`MAX_ROWS` rows (leading axes
    flattened), in ``out_dtype`` (default ``x.dtype``); float32 accumulation.

    Raises
    ------
    ValueError
        More than :data:`MAX_ROWS` rows, a width mismatch, a weight whose last axis is not
        contiguous, or dtypes other than float16 / bfloat16 (``x`` and ``weight`` alike).
    """
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x of width {x.shape[-1]} for a weight of {tuple(weight.shape)}")
    if weight.stride(-1) != 1:
        raise ValueError("weight's last axis must be contiguous")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"float16 / bfloat16 only, got x {x.dtype} and weight {weight.dtype}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"{m} rows; at most {MAX_ROWS}")
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m and n:
        if k == 0:
            y.zero_()
            if bias is not None:
                y += bias
        else:
            cfg = config or pick_config(n, k, m)
            pdl = pdl_enabled(x.device)
            _skinny_kernel[(triton.cdiv(n, cfg.block_n),)](
                x2, weight, bias if bias is not None else weight, y,
                m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
                HAS_BIAS=bias is not None, ONE_ROW=m == 1, UPCAST=_interpreted(),
                BLOCK_M=1 if m == 1 else MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=pdl,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(pdl),
            )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)
