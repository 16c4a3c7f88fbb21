"""Greedy token choice on CUDA: the argmax of each row of the logits, in two short launches.

``torch.argmax`` over one row of a vocabulary reduces it in a single thread block, so at small
batches it can take longer than the LM head before it. Here ``S`` programs per row each reduce one
chunk, and a second launch picks the best chunk. The chunk count is a run-time argument that
Triton does not specialize on, and the second kernel's block is its next power of two, so the
launch plans of every batch size need a handful of compiles, all made at start-up by
:func:`warm_up` (a compile mid-run would stall a step for a tenth of a second or more)::

    part[b, s] = (max, first index of the max) over logits[b, s * C : (s + 1) * C]
    out[b] = index of the first chunk holding the row's max

Ties go to the lowest index, as in ``torch.argmax``; a row of ``-inf`` gives 0. Rows holding NaN
are not defined here (torch would return a NaN's index). ``S`` depends on shapes only, so the
call can sit in a captured graph. The oracle is ``torch.argmax`` (``tests/kernels``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["argmax_rows", "launch_plan", "num_chunks", "plan_rows", "warm_up"]

_BLOCK = 1024
_TARGET_PROGRAMS = 264  # two waves of a 132-SM GPU (Hopper's count), enough to fill smaller ones
_MAX_CHUNKS = 64


# ``num_chunks`` unspecialized: its divisibility changes with the batch size, and each new value
# class would compile the kernel again in the middle of serving
@triton.jit(do_not_specialize=["num_chunks"])
def _chunk_argmax_kernel(
    x_ptr, val_ptr, idx_ptr, V, stride_xb, CHUNK, num_chunks,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # grid: (rows, num_chunks)
    b = tl.program_id(0)
    s = tl.program_id(1)
    row = x_ptr + b.to(tl.int64) * stride_xb
    start = s * CHUNK
    end = tl.minimum(start + CHUNK, V)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int32)
    for v0 in range(start, end, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        vals = tl.load(row + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
        m, i = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = m > best  # strict: an equal max later in the row keeps the earlier index
        best_i = tl.where(better, v0 + i, best_i)
        best = tl.where(better, m, best)
    tl.store(val_ptr + b * num_chunks + s, best)
    tl.store(idx_ptr + b * num_chunks + s, best_i)


@triton.jit(do_not_specialize=["num_chunks"])
def _pick_chunk_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_S: tl.constexpr):
    # grid: (rows,)
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    mask = offs < num_chunks
    vals = tl.load(val_ptr + b * num_chunks + offs, mask=mask, other=float("-inf"))
    idxs = tl.load(idx_ptr + b * num_chunks + offs, mask=mask, other=0)
    m = tl.max(vals, axis=0)
    # the first chunk holding the max: chunks are in row order, so its index is the lowest
    first = tl.min(tl.where(mask & (vals == m), offs, BLOCK_S), axis=0)
    pick = tl.sum(tl.where(offs == first, idxs, 0), axis=0)
    tl.store(out_ptr + b, pick.to(tl.int64))


def num_chunks(rows: int, vocab: int) -> int:
    """Chunks per row: about two waves of programs, each chunk at least one block long."""
    by_programs = triton.cdiv(_TARGET_PROGRAMS, max(rows, 1))
    by_length = triton.cdiv(vocab, _BLOCK)
    return max(1, min(_MAX_CHUNKS, by_programs, by_length))


def launch_plan(rows: int, vocab: int) -> tuple[int, int, int]:
    """``(chunk length, chunks per row, block of the second kernel)`` for ``[rows, vocab]``."""
    s = num_chunks(rows, vocab)
    chunk = triton.cdiv(triton.cdiv(vocab, s), _BLOCK) * _BLOCK
    s = triton.cdiv(vocab, chunk)  # no empty chunk
    return chunk, s, max(2, triton.next_power_of_2(s))


def plan_rows(vocab: int) -> list[int]:
    """The smallest row count of each launch plan's compiled variant (its second kernel's block,
    the only compile-time value that depends on the batch): every batch size compiles nothing
    new after these. Past ``_TARGET_PROGRAMS`` rows the plan no longer changes."""
    first: dict[int, int] = {}
    for rows in range(1, _TARGET_PROGRAMS + 1):
        first.setdefault(launch_plan(rows, vocab)[2], rows)
    return sorted(first.values())


def warm_up(vocab: int, device: torch.device | str) -> int:
    """Compile :func:`argmax_rows` for every batch size of a ``vocab``-wide float32 logits row
    (one call per :func:`plan_rows`), at start-up rather than mid-run. Returns the calls made."""
    rows = plan_rows(vocab)
    for n in rows:
        argmax_rows(torch.zeros((n, vocab), dtype=torch.float32, device=device))
    return len(rows)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a 2-D float tensor ``[B, V]`` with a contiguous last axis; int64 ``[B]``."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [B, V] with a contiguous last axis, got {tuple(x.shape)}")
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    if vocab == 0:
        raise ValueError("argmax of an empty row")
    chunk, s, block_s = launch_plan(rows, vocab)
    vals = torch.empty((rows, s), dtype=torch.float32, device=x.device)
    idxs = torch.empty((rows, s), dtype=torch.int32, device=x.device)
    _chunk_argmax_kernel[(rows, s)](x, vals, idxs, vocab, x.stride(0), chunk, s, BLOCK=_BLOCK, num_warps=4)
    _pick_chunk_kernel[(rows,)](vals, idxs, out, s, BLOCK_S=block_s, num_warps=1)
    return out
