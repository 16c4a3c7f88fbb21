"""One chain step's layout in one launch (``chain_decode.py``): the walk over a row's forced
tokens, the padded pass's inputs, the row's new state and position.

Per row ``b`` (one program), with ``s = state[rows[b]]``, ``p = pos[b]`` and ``W`` nodes::

    for i < W - 1, while chain[s] >= 0:  f_i = chain[s];  s = next(s, f_i)   (binary search)
    ids       = [cur[b], f_0 .. f_{L-1}, 0 ...]         positions = p + node
    node_slots = block[b, p - start[b] + node] for node <= L, the padding slot after;
                 req_to_token[rows[b], p + node] = that slot
    tree_mask[node] = nodes 0..node for node <= L, itself alone after
    last = b * W + L,  counts = L + 1,  state[rows[b]] = s,  pos[b] = p + L + 1

The oracle is :func:`~phloem.runtime.executor.chain_decode.chain_layout` (torch), in
``tests/kernels/chain_cases.py``. Nothing that changes with the batch or the grammar (key count,
search depth) is specialized on; ``W`` is, and one width serves an engine's whole life.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from phloem.runtime.cache.kv_pool import PADDING_SLOT

__all__ = ["chain_layout_triton"]


@triton.jit(do_not_specialize=["V", "num_keys", "search_steps", "table_stride", "table_width", "block_width"])
def _chain_layout_kernel(
    state_ptr, rows_ptr, chain_ptr, keys_ptr, targets_ptr, table_ptr, table_stride, table_width,
    cur_ptr, pos_ptr, start_ptr, block_ptr, block_width, ids_ptr, positions_ptr, slots_ptr, srows_ptr,
    prefix_ptr, mask_ptr, last_ptr, emitted_ptr, counts_ptr, V, num_keys, search_steps, PADDING,
    W: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b)
    s = tl.load(state_ptr + row)
    p = tl.load(pos_ptr + b)
    taken = p - tl.load(start_ptr + b)  # block slots this row's launch used before this step
    n = tl.zeros((), dtype=tl.int64)
    alive = tl.full((), 1, tl.int1)
    for i in tl.static_range(W - 1):
        f = tl.load(chain_ptr + s).to(tl.int64)
        alive = alive & (f >= 0)
        key = s.to(tl.int64) * V + tl.maximum(f, 0)
        lo = tl.zeros((), dtype=tl.int64)
        hi = tl.zeros((), dtype=tl.int64) + num_keys
        for _ in range(search_steps):  # lower bound of key in the sorted keys
            active = lo < hi
            mid = (lo + hi) // 2
            k = tl.load(keys_ptr + mid, mask=active, other=0)
            lo = tl.where(active & (k < key), mid + 1, lo)
            hi = tl.where(active & (k >= key), mid, hi)
        found = tl.load(keys_ptr + lo) == key  # in range: the last key is a sentinel above any key
        nxt = tl.where(found, tl.load(targets_ptr + lo), 0)
        s = tl.where(alive, nxt, s)
        tl.store(emitted_ptr + b * W + i, tl.where(alive, f, -1))
        tl.store(ids_ptr + b * W + 1 + i, tl.where(alive, f, 0))
        n += alive.to(tl.int64)
    tl.store(emitted_ptr + b * W + W - 1, -1)
    tl.store(state_ptr + row, s)
    node = tl.arange(0, BLOCK_W)
    inside = node < W
    real = node <= n
    where = p + node
    tl.store(ids_ptr + b * W, tl.load(cur_ptr + b))
    tl.store(positions_ptr + b * W + node, where, mask=inside)
    give = inside & real & (taken + node < block_width) & (where < table_width)
    slot = tl.load(block_ptr + b * block_width + taken + node, mask=give, other=0)
    tl.store(table_ptr + row * table_stride + where, slot, mask=give)
    tl.store(slots_ptr + b * W + node, tl.where(real, slot, PADDING), mask=inside)
    for i in tl.static_range(W):
        sees = ((node <= i) & (i <= n)) | (node == i)
        tl.store(mask_ptr + (b * W + i) * W + node, sees.to(tl.int8), mask=inside)
    tl.store(srows_ptr + b, row)
    tl.store(prefix_ptr + b, p)
    tl.store(last_ptr + b, b * W + n)
    tl.store(counts_ptr + b, n + 1)
    tl.store(pos_ptr + b, p + n + 1)


def chain_layout_triton(
    *,
    state: torch.Tensor,
    rows: torch.Tensor,
    chain: torch.Tensor,
    keys: torch.Tensor,
    targets: torch.Tensor,
    vocab: int,
    req_to_token: torch.Tensor,
    cur: torch.Tensor,
    pos: torch.Tensor,
    start: torch.Tensor,
    block: torch.Tensor,
    out: dict[str, torch.Tensor],
    emitted: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """:func:`~phloem.runtime.executor.chain_decode.chain_layout` in one launch (same arguments;
    ``ids``, ``positions``, ``node_slots``, ``rows``, ``prefix``, ``last``, ``emitted``, ``counts``,
    ``cur``, ``pos``, ``start``, ``block`` int64, ``state`` and ``chain`` and ``targets`` int32,
    every buffer contiguous)."""
    batch, w = emitted.shape
    if batch == 0:
        return
    n = keys.shape[0]
    _chain_layout_kernel[(batch,)](
        state, rows, chain, keys, targets, req_to_token, req_to_token.stride(0), req_to_token.shape[1],
        cur, pos, start, block, block.shape[1], out["ids"], out["positions"], out["node_slots"], out["rows"],
        out["prefix"], out["tree_mask"], out["last"], emitted, counts, vocab, n, max(1, n.bit_length()),
        PADDING_SLOT,
        W=w, BLOCK_W=triton.next_power_of_2(w), num_warps=1,
    )  # fmt: skip
