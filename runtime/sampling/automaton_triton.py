"""Greedy decoding under device automata in two launches: the masked argmax and the state update.

A greedy batch whose rows follow token automata (``phloem.grammars.automaton``) needs, per step,
each row's state, its mask row, the argmax of the allowed logits and the next state. In torch
that is a dozen small launches, which at a small model's step time cost more than the forward
pass. Here, with ``state = state_buf[rows[b]]`` and ``W`` words per mask row::

    part[b, s] = (max, first index) over allowed t in chunk s of logits[b]
                 (t allowed when bit t % 32 of masks[state, t // 32] is set)
    token[b]   = index of the first chunk holding the row's max         (second launch, which also)
    state_buf[rows[b]] = targets[i] if keys[i] == state * V + token else FREE,
                 i = first index with keys[i] >= state * V + token      (binary search; FREE stays)

The chunking is the greedy argmax's (``argmax_triton.launch_plan``); ties go to the lowest index.
As there, nothing that changes with the batch or the grammar (chunk count, key count, search
depth) is specialized on, and :func:`warm_up` compiles every launch plan at start-up.
The oracle is the torch path (``grammars.automaton`` masks and ``advance`` with ``argmax``), in
``tests/kernels/automaton_cases.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from phloem.runtime.sampling.argmax_triton import _BLOCK, launch_plan, plan_rows

__all__ = ["automaton_greedy", "warm_up"]


@triton.jit(do_not_specialize=["W", "num_chunks"])  # W: the grammar side's vocabulary may differ
def _masked_chunk_argmax_kernel(
    x_ptr, val_ptr, idx_ptr, state_ptr, rows_ptr, mask_ptr, V, W, stride_xb, CHUNK, num_chunks,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # grid: (rows, num_chunks)
    b = tl.program_id(0)
    s = tl.program_id(1)
    state = tl.load(state_ptr + tl.load(rows_ptr + b))
    mask_row = mask_ptr + state.to(tl.int64) * W
    row = x_ptr + b.to(tl.int64) * stride_xb
    start = s * CHUNK
    end = tl.minimum(start + CHUNK, V)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int32)
    for v0 in range(start, end, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        inside = offs < end
        words = tl.load(mask_row + offs // 32, mask=inside & (offs // 32 < W), other=0)
        allowed = inside & (((words >> (offs % 32)) & 1) != 0)
        vals = tl.load(row + offs, mask=allowed, other=float("-inf")).to(tl.float32)
        m, i = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = m > best  # strict: an equal max later in the row keeps the earlier index
        best_i = tl.where(better, v0 + i, best_i)
        best = tl.where(better, m, best)
    tl.store(val_ptr + b * num_chunks + s, best)
    tl.store(idx_ptr + b * num_chunks + s, best_i)


@triton.jit(do_not_specialize=["num_chunks", "num_keys", "search_steps"])
def _pick_and_advance_kernel(
    val_ptr, idx_ptr, out_ptr, state_ptr, rows_ptr, keys_ptr, targets_ptr, V, num_chunks, num_keys,
    search_steps, BLOCK_S: tl.constexpr,
):  # fmt: skip
    # grid: (rows,)
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    mask = offs < num_chunks
    vals = tl.load(val_ptr + b * num_chunks + offs, mask=mask, other=float("-inf"))
    idxs = tl.load(idx_ptr + b * num_chunks + offs, mask=mask, other=0)
    m = tl.max(vals, axis=0)
    # the first chunk holding the max: chunks are in row order, so its index is the lowest
    first = tl.min(tl.where(mask & (vals == m), offs, BLOCK_S), axis=0)
    token = tl.sum(tl.where(offs == first, idxs, 0), axis=0).to(tl.int64)
    tl.store(out_ptr + b, token)
    row = tl.load(rows_ptr + b)
    state = tl.load(state_ptr + row)
    key = state.to(tl.int64) * V + token
    lo = tl.zeros((), dtype=tl.int64)
    hi = tl.zeros((), dtype=tl.int64) + num_keys
    for _ in range(search_steps):  # lower bound of key in the sorted keys
        active = lo < hi
        mid = (lo + hi) // 2
        k = tl.load(keys_ptr + mid, mask=active, other=0)
        lo = tl.where(active & (k < key), mid + 1, lo)
        hi = tl.where(active & (k >= key), mid, hi)
    found = tl.load(keys_ptr + lo) == key  # in range: the last key is a sentinel above any key
    nxt = tl.where(found & (state != 0), tl.load(targets_ptr + lo), 0)
    tl.store(state_ptr + row, nxt.to(tl.int32))


def automaton_greedy(
    logits: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    masks: torch.Tensor,
    keys: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """Greedy tokens ``[B]`` (int64) of ``logits [B, V]`` under each row's automaton state
    ``state[rows[b]]``, which is then advanced over the token in place (see the module docstring).

    ``masks [S, W]`` int32, ``keys [T]`` int64 sorted with a sentinel last, ``targets [T]`` int32,
    ``state`` int32, ``rows`` int64: all on the device of ``logits``."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [B, V] with a contiguous last axis, got {tuple(logits.shape)}")
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    chunk, s, block_s = launch_plan(batch, vocab)
    vals = torch.empty((batch, s), dtype=torch.float32, device=logits.device)
    idxs = torch.empty((batch, s), dtype=torch.int32, device=logits.device)
    _masked_chunk_argmax_kernel[(batch, s)](
        logits, vals, idxs, state, rows, masks, vocab, masks.shape[1], logits.stride(0), chunk, s,
        BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip
    n = keys.shape[0]
    _pick_and_advance_kernel[(batch,)](
        vals, idxs, out, state, rows, keys, targets, vocab, s, n, max(1, n.bit_length()),
        BLOCK_S=block_s, num_warps=1,
    )  # fmt: skip
    return out


def warm_up(vocab: int, device: torch.device | str) -> int:
    """Compile :func:`automaton_greedy` for every batch size of ``vocab``-wide float32 logits (one
    call per ``plan_rows``), over a one-state automaton that allows every token, at start-up
    rather than mid-run. Returns the calls made."""
    words = triton.cdiv(vocab, 32)
    masks = torch.full((1, words), -1, dtype=torch.int32, device=device)
    keys = torch.full((1,), 2**62, dtype=torch.int64, device=device)  # the sentinel alone
    targets = torch.zeros(1, dtype=torch.int32, device=device)
    rows = plan_rows(vocab)
    for n in rows:
        state = torch.zeros(n, dtype=torch.int32, device=device)
        automaton_greedy(torch.zeros((n, vocab), dtype=torch.float32, device=device), state,
                         torch.arange(n, device=device), masks, keys, targets)  # fmt: skip
    return len(rows)
