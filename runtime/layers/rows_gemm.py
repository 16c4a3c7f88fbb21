"""``y = x @ W.T`` for 17-256 rows: weight tiles as the wide operand, rows in exact chunks, split K.

A decode step of a large model multiplies the batch's rows (tens to a couple of hundred) by each
projection's weight ``[N, K]``. A GEMM library tiles the rows by 64 or 128: at 208 rows it pays
for 256, and a projection of a few thousand columns leaves much of the GPU idle in its last wave
(measured by ``benchmarks/gpu/gemm_rows.py``: Llama-3-8B's attention output takes 18.5 us at 208
rows against a floor of 8.8). This kernel turns the product around: each program holds
``BLOCK_N`` rows of ``W`` as the matrix unit's wide operand and multiplies them by every row of
``x`` at once, as ``W_tile @ x_chunk.T`` for a few chunks of rows whose sizes are powers of two
(208 = 128 + 64 + 16), so no padded row is computed beyond the next multiple of 16. The key axis
is split ``SPLIT_K`` ways so the programs fill the GPU. As a plain loop::

    for n0 in range(0, N, BLOCK_N):                     # grid axis 0
        for s in range(SPLIT_K):                        # grid axis 1: one range of K each
            part[s] = W[n0:n0+BLOCK_N, K_s] @ x[:, K_s].T   # [BLOCK_N, M], float32
        y[:, n0:n0+BLOCK_N] = sum_s part[s]  (.T, rounded to x's dtype)

With ``SPLIT_K > 1`` each program writes its float32 partial to a workspace and bumps a counter of
its column block; the last of the ``SPLIT_K`` to arrive adds the others' partials to its own and
writes ``y`` (and resets the counter, so the next call, or a graph replay, finds it at zero). The
grid depends on shapes only, so calls can be captured in a CUDA graph.

The oracle is ``torch.nn.functional.linear`` (``tests/kernels/rows_gemm_cases.py``).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from phloem.runtime.layers.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait

__all__ = ["MAX_ROWS", "MIN_ROWS", "RowsConfig", "row_chunks", "rows_linear"]

MIN_ROWS = 17  # fewer rows go to the skinny kernel (or the library)
MAX_ROWS = 256
_DTYPES = (torch.float16, torch.bfloat16)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # see skinny_gemm: bf16 dots upcast there
_counters: dict[tuple[int, int], torch.Tensor] = {}  # (device index, stream id) -> int32 zeros


class RowsConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def row_chunks(m: int) -> tuple[int, int, int, int]:
    """``m`` rounded up to a multiple of 16, as descending powers of two of at least 16 (four at
    most; unused ones are 0): ``208 -> (128, 64, 16, 0)``."""
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"{m} rows; 1 to {MAX_ROWS}")
    left = -(-m // 16) * 16
    chunks = []
    for size in (256, 128, 64, 32, 16):
        if left >= size:
            chunks.append(size)
            left -= size
    return tuple(chunks + [0] * (4 - len(chunks)))  # type: ignore[return-value]


@triton.jit
def _chunk_dot(
    acc, w, x_ptr, ROW0: tl.constexpr, R: tl.constexpr, M, stride_xm, kk, k_mask, UPCAST: tl.constexpr
):
    offs_m = ROW0 + tl.arange(0, R)
    x = tl.load(
        x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
        mask=(offs_m < M)[:, None] & k_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc)
    return tl.dot(w, tl.trans(x), acc)


@triton.jit
def _chunk_store(acc, ptr, ROW0: tl.constexpr, R: tl.constexpr, M, stride_m, offs_n, n_mask):
    offs_m = ROW0 + tl.arange(0, R)
    mask = n_mask[:, None] & (offs_m < M)[None, :]
    tl.store(ptr + offs_m[None, :] * stride_m + offs_n[:, None], acc.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_gather(acc, part_ptr, ROW0: tl.constexpr, R: tl.constexpr, M, N, pid_k, SPLIT_K: tl.constexpr,
                  offs_n, n_mask):  # fmt: skip
    # the last program of a column block adds every other split's partial to its own
    offs_m = ROW0 + tl.arange(0, R)
    mask = n_mask[:, None] & (offs_m < M)[None, :]
    idx = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    for s in range(SPLIT_K):
        if s != pid_k:
            acc += tl.load(part_ptr + s * M * N + idx, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _rows_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym,
    R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(N, BLOCK_N), SPLIT_K)
    pdl_trigger(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = pid_k * per_split
    k_hi = tl.minimum(k_lo + per_split, K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    pdl_wait(PDL)
    acc0 = tl.zeros((BLOCK_N, R0), tl.float32)
    if R1 > 0:
        acc1 = tl.zeros((BLOCK_N, R1), tl.float32)
    if R2 > 0:
        acc2 = tl.zeros((BLOCK_N, R2), tl.float32)
    if R3 > 0:
        acc3 = tl.zeros((BLOCK_N, R3), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k_hi
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc0 = _chunk_dot(acc0, w, x_ptr, 0, R0, M, stride_xm, kk, k_mask, UPCAST)
        if R1 > 0:
            acc1 = _chunk_dot(acc1, w, x_ptr, R0, R1, M, stride_xm, kk, k_mask, UPCAST)
        if R2 > 0:
            acc2 = _chunk_dot(acc2, w, x_ptr, R0 + R1, R2, M, stride_xm, kk, k_mask, UPCAST)
        if R3 > 0:
            acc3 = _chunk_dot(acc3, w, x_ptr, R0 + R1 + R2, R3, M, stride_xm, kk, k_mask, UPCAST)
    if SPLIT_K == 1:
        _chunk_store(acc0, y_ptr, 0, R0, M, stride_ym, offs_n, n_mask)
        if R1 > 0:
            _chunk_store(acc1, y_ptr, R0, R1, M, stride_ym, offs_n, n_mask)
        if R2 > 0:
            _chunk_store(acc2, y_ptr, R0 + R1, R2, M, stride_ym, offs_n, n_mask)
        if R3 > 0:
            _chunk_store(acc3, y_ptr, R0 + R1 + R2, R3, M, stride_ym, offs_n, n_mask)
    else:
        part = part_ptr + pid_k.to(tl.int64) * M * N
        _chunk_store(acc0, part, 0, R0, M, N, offs_n, n_mask)
        if R1 > 0:
            _chunk_store(acc1, part, R0, R1, M, N, offs_n, n_mask)
        if R2 > 0:
            _chunk_store(acc2, part, R0 + R1, R2, M, N, offs_n, n_mask)
        if R3 > 0:
            _chunk_store(acc3, part, R0 + R1 + R2, R3, M, N, offs_n, n_mask)
        tl.debug_barrier()  # every thread's partial is written before the count says so
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc0 = _chunk_gather(acc0, part_ptr, 0, R0, M, N, pid_k, SPLIT_K, offs_n, n_mask)
            _chunk_store(acc0, y_ptr, 0, R0, M, stride_ym, offs_n, n_mask)
            if R1 > 0:
                acc1 = _chunk_gather(acc1, part_ptr, R0, R1, M, N, pid_k, SPLIT_K, offs_n, n_mask)
                _chunk_store(acc1, y_ptr, R0, R1, M, stride_ym, offs_n, n_mask)
            if R2 > 0:
                acc2 = _chunk_gather(acc2, part_ptr, R0 + R1, R2, M, N, pid_k, SPLIT_K, offs_n, n_mask)
                _chunk_store(acc2, y_ptr, R0 + R1, R2, M, stride_ym, offs_n, n_mask)
            if R3 > 0:
                acc3 = _chunk_gather(acc3, part_ptr, R0 + R1 + R2, R3, M, N, pid_k, SPLIT_K, offs_n, n_mask)
                _chunk_store(acc3, y_ptr, R0 + R1 + R2, R3, M, stride_ym, offs_n, n_mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)


def _counter(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counts for the current stream, at least ``tiles`` long. Every call
    leaves them at zero, so one array serves every call (and graph) of that stream."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, torch.cuda.current_stream(device).stream_id)
    else:  # the interpreter
        key = (-1, 0)
    buf = _counters.get(key)
    if buf is None or buf.numel() < tiles:
        buf = _counters[key] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return buf


def pick_config(n: int, k: int, rows: int) -> RowsConfig:
    """Default block sizes for an ``[N, K]`` weight and ``rows`` rows (placeholder until swept)."""
    block_n = 64 if n <= 8192 else 128
    tiles = triton.cdiv(n, block_n)
    split = max(1, min(8, 264 // max(tiles, 1)))
    return RowsConfig(block_n, 64, split, 4, 4)


def rows_linear(x: torch.Tensor, weight: torch.Tensor, *, config: RowsConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` for ``x`` of 1 to :data:`MAX_ROWS` rows (leading axes flattened),
    float32 accumulation, in ``x``'s dtype.

    Raises
    ------
    ValueError
        No rows or more than :data:`MAX_ROWS`, a width mismatch, a weight whose last axis is not
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
    r0, r1, r2, r3 = row_chunks(m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y.reshape(*x.shape[:-1], n)
    if k == 0:
        return y.zero_().reshape(*x.shape[:-1], n)
    cfg = config or pick_config(n, k, m)
    tiles = triton.cdiv(n, cfg.block_n)
    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    count = _counter(x.device, tiles) if split > 1 else y
    pdl = pdl_enabled(x.device)
    _rows_kernel[(tiles, split)](
        x2, weight, y, part, count,
        m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
        R0=r0, R1=r1, R2=r2, R3=r3, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
        UPCAST=_INTERPRETED, PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(pdl),
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)
