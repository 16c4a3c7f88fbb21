"""Weights pulled into L2 ahead of the kernel that reads them (Hopper bulk prefetch).

At a few requests a decode layer's attention reads a few hundred kilobytes of K/V and spends
its microseconds waiting on a chain of dependent loads: HBM sits idle between the qkv projection
that ends before it and the output projection that starts after it. A kernel that runs there
can ask the copy engine of its SM to bring the next weights into L2
(``cp.async.bulk.prefetch.L2``: one instruction a span, no registers, nothing waits on it), so
the projection after it reads them from L2.

The spans are fixed for a model (weights do not move), so they are laid out once per layer as a
small device table of ``(address, bytes)`` pairs (:func:`prefetch_table`, :func:`plan_spans`):
the weights in the order they are read, whole while they fit ``budget`` bytes, then the leading
columns of every row of the first one that does not fit (a projection's programs read a weight column block by
column block, so a row-prefix would leave some programs all their bytes to fetch). A kernel
reads its share of the table (:func:`l2_spans`) before its PDL wait and issues it
(:func:`l2_prefetch`) after, when the kernel before it (which streams its own weights) has
finished.

The table must not outlive the weights it points into. Prefetching never changes a result.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

__all__ = ["BUDGET_ENV", "budget_bytes", "l2_prefetch", "l2_spans", "lanes", "plan_spans", "prefetch_table"]

BUDGET_ENV = "PHLOEM_DECODE_L2_MB"
DEFAULT_BUDGET_MB = 32  # about two thirds of an H200's 50 MB of L2
PIECE = 32 << 10  # bytes of one contiguous span: an entry per piece of a whole weight
_ALIGN = 16  # the bulk prefetch's address and size granularity


def budget_bytes() -> int:
    """Bytes of weights to prefetch after each attention (``PHLOEM_DECODE_L2_MB``; 0 turns it off)."""
    text = os.environ.get(BUDGET_ENV, str(DEFAULT_BUDGET_MB))
    try:
        mb = float(text)
    except ValueError:
        raise ValueError(f"{BUDGET_ENV} must be a number of megabytes, got {text!r}") from None
    return max(int(mb * (1 << 20)), 0)


def prefetch_table(weights: Sequence[torch.Tensor], budget: int, piece: int = PIECE) -> torch.Tensor | None:
    """``[n, 2]`` int64 ``(address, bytes)`` spans of :func:`plan_spans` on the weights' device
    (CUDA only); ``None`` when nothing is covered."""
    if not weights or any(w.device.type != "cuda" for w in weights):
        return None
    spans = plan_spans(weights, budget, piece)
    if not spans:
        return None
    return torch.tensor(spans, dtype=torch.int64).to(weights[0].device)


def plan_spans(weights: Sequence[torch.Tensor], budget: int, piece: int = PIECE) -> list[tuple[int, int]]:
    """``(address, bytes)`` spans covering ``weights`` (2-D, in the order they are read) up to
    ``budget`` bytes.

    A weight that fits what is left of the budget is covered whole, in pieces of ``piece`` bytes
    when its rows are contiguous (else a span a row); the first that does not fit gets the
    leading columns of each row (a multiple of 16 bytes), and the weights after it none. A
    weight that is not 2-D with unit column stride and 16-byte aligned rows ends the plan where
    it stands."""
    spans: list[tuple[int, int]] = []
    left = budget
    for w in weights:
        if left < _ALIGN or not _prefetchable(w):
            break
        rows, row_bytes = w.shape[0], w.shape[1] * w.element_size()
        stride = w.stride(0) * w.element_size()
        base = w.data_ptr()
        if rows * row_bytes <= left:
            left -= rows * row_bytes
            if stride == row_bytes:  # one contiguous block: in pieces
                total = rows * row_bytes
                spans.extend((base + o, min(piece, total - o)) for o in range(0, total, piece))
            else:
                spans.extend((base + r * stride, row_bytes) for r in range(rows))
            continue
        cols = min(row_bytes, left // rows) // _ALIGN * _ALIGN  # leading bytes of every row
        if cols > 0:
            spans.extend((base + r * stride, cols) for r in range(rows))
        break
    return spans


def _prefetchable(w: torch.Tensor) -> bool:
    return (
        w.dim() == 2
        and w.stride(1) == 1
        and w.data_ptr() % _ALIGN == 0
        and (w.shape[1] * w.element_size()) % _ALIGN == 0
        and (w.stride(0) * w.element_size()) % _ALIGN == 0
    )


def lanes(n_spans: int, num_programs: int, num_warps: int) -> int:
    """The ``BLOCK`` of :func:`l2_spans`: a power of two that holds one program's share, and at
    least a lane per thread. A block smaller than the program would be replicated across its
    threads, and each copy of a lane would issue its prefetch again."""
    return max(triton.next_power_of_2(max(1, triton.cdiv(n_spans, num_programs))), 32 * num_warps)


@triton.jit
def l2_spans(table_ptr, n_spans, pid, num_programs, BLOCK: tl.constexpr):
    """Program ``pid``'s contiguous share of the table (at most ``BLOCK`` spans, see :func:`lanes`):
    addresses, sizes and which lanes hold one. The table never changes, so a PDL kernel may read
    it before its wait and issue :func:`l2_prefetch` after it, without waiting on the load."""
    per = tl.cdiv(n_spans, num_programs)
    i = pid * per + tl.arange(0, BLOCK)
    live = (i < (pid + 1) * per) & (i < n_spans)
    addr = tl.load(table_ptr + 2 * i, mask=live, other=0)
    size = tl.load(table_ptr + 2 * i + 1, mask=live, other=0).to(tl.int32)
    return addr, size, live.to(tl.int32)


@triton.jit
def l2_prefetch(addr, size, live):
    """One bulk prefetch into L2 per live lane (from :func:`l2_spans`); nothing waits on it."""
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $3, 0;\n\t"
        "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l,r,r",
        [addr, size, live],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
