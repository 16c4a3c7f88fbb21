"""The stop-flag update of early exit (``decode_exit``) as one Triton program over the batch.

Per row ``b < B``, with ``row = rows[b]``::

    done[row] = tags[b]      if tokens[b] equals one of stop_ids[b, :K] (entries < 0 pad)
    live[b]   = done[row] != tags[b]
    go        = any(live);   skipped += !go  (when COUNT)

The oracle is ``decode_exit.stop_flags_reference`` (``tests/kernels/test_decode_exit.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["stop_flags"]


@triton.jit(do_not_specialize=["B", "K", "COUNT"])  # one compile per block width
def _stop_flags_kernel(
    done_ptr, rows_ptr, tags_ptr, stop_ptr, tokens_ptr, go_ptr, skipped_ptr, B, K, COUNT,
    HAS_TOKENS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # grid: (1,); a batch is at most a few hundred rows
    offs = tl.arange(0, BLOCK)
    inside = offs < B
    rows = tl.load(rows_ptr + offs, mask=inside, other=0)
    tags = tl.load(tags_ptr + offs, mask=inside, other=0)
    done = tl.load(done_ptr + rows, mask=inside, other=0)
    if HAS_TOKENS:
        tokens = tl.load(tokens_ptr + offs, mask=inside, other=-1)
        hit = tl.zeros((BLOCK,), dtype=tl.int1)
        for k in range(K):
            stop = tl.load(stop_ptr + offs * K + k, mask=inside, other=-1)
            hit = hit | ((tokens == stop) & (stop >= 0))
        hit = hit & inside
        tl.store(done_ptr + rows, tags, mask=hit)
        done = tl.where(hit, tags, done)
    live = inside & (done != tags)
    go = tl.max(live.to(tl.int32), axis=0)
    tl.store(go_ptr, go != 0)
    if COUNT != 0:
        tl.store(skipped_ptr, tl.load(skipped_ptr) + (1 - go).to(tl.int64))


def stop_flags(
    done: torch.Tensor,
    rows: torch.Tensor,
    tags: torch.Tensor,
    stop_ids: torch.Tensor,
    tokens: torch.Tensor | None,
    go: torch.Tensor,
    skipped: torch.Tensor,
    *,
    count: bool = True,
) -> None:
    """Update ``done`` and ``go`` (and ``skipped``) in place; see the module docstring."""
    batch = rows.shape[0]
    stop_ids = stop_ids.contiguous()
    _stop_flags_kernel[(1,)](
        done, rows, tags, stop_ids, tokens if tokens is not None else rows, go, skipped, batch,
        stop_ids.shape[1], int(count), HAS_TOKENS=tokens is not None, BLOCK=block_for(batch), num_warps=4,
    )  # fmt: skip


def block_for(batch: int) -> int:
    """The program's width for ``batch`` rows (a power of two, at least 32): a handful of compiles."""
    return max(32, triton.next_power_of_2(batch))
