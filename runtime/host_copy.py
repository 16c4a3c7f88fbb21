"""Host-to-device copies that never stall the host (docs/design.md §5, the overlap loop).

A copy from pageable host memory makes CUDA synchronize the stream before it starts: a scheduler
thread that writes a few slot numbers into the device-side ``req_to_token`` would wait there for
the forward pass in flight, and the overlap loop would overlap nothing. Copies from pinned memory
are queued like kernels and return at once. PyTorch's caching host allocator hands a pinned block
out again only after the copies that read it have completed, so a staging buffer per call is safe.

``pack_to_device`` also turns the dozen small tensors of a step's input into one copy per dtype:
each copy costs a few microseconds of launch work whatever its size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["pack_to_device", "to_device", "to_host_async"]

# Host tensors at least this large and already pinned are copied on their own (packing would
# add a host copy of them).
_PACK_LIMIT = 1 << 16
# Every packed tensor starts at a multiple of this many bytes. Triton compiles a kernel once per
# pattern of 16-byte-aligned pointer arguments: a view at an odd int64 offset (it depends on the
# sizes packed before it, so on the batch) would make a kernel compile again mid-run.
PACK_ALIGN_BYTES = 16
_ZEROS: dict[torch.dtype, torch.Tensor] = {}  # padding between packed parts, one per dtype


def to_host_async(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A flat int64 host copy of ``t`` and, for a device tensor, the event that marks it filled.

    Reading slot numbers back from the device-side ``req_to_token`` (a finished request's row,
    for the radix tree and the allocator) with ``.to("cpu")`` would wait for every step queued on
    the stream, the one in flight included: the overlap loop's next launch would then find the GPU
    idle. The copy here lands in a pinned buffer in stream order and returns at once; whoever reads
    the buffer's values must ``synchronize()`` the event first (by then it has usually fired)."""
    if t.device.type == "cpu":
        return t.detach().reshape(-1).to(dtype=torch.int64).clone(), None
    host = torch.empty(t.numel(), dtype=torch.int64, pin_memory=True)
    host.copy_(t.detach().reshape(-1), non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without blocking the host (``t`` itself when it is there already).

    A small host tensor always goes through a fresh pinned staging buffer: asking CUDA whether
    it is pinned already (``is_pinned``) costs the host more than the copy, and it would be paid
    for every admitted request."""
    if t.device == device or device.type == "cpu":
        return t if t.device == device else t.to(device)
    if t.device.type == "cpu":
        if t.numel() < _PACK_LIMIT:
            staging = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            t = staging.copy_(t)
        elif not t.is_pinned():
            t = t.pin_memory()
    return t.to(device, non_blocking=True)


def pack_to_device(tensors: Sequence[torch.Tensor | None], device: torch.device) -> list[torch.Tensor | None]:
    """The same tensors on ``device`` (``None`` stays ``None``): host tensors of one dtype travel
    in one pinned staging buffer and one asynchronous copy; results are views of that copy."""
    out: list[torch.Tensor | None] = list(tensors)
    if device.type == "cpu":
        return [None if t is None else t.to(device) for t in tensors]
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t is None or t.device == device:
            continue
        if t.device.type != "cpu" or (t.numel() >= _PACK_LIMIT and t.is_pinned()):
            out[i] = to_device(t, device)
            continue
        groups.setdefault(t.dtype, []).append(i)
    for dtype, idx in groups.items():
        parts = [tensors[i].reshape(-1) for i in idx]  # type: ignore[union-attr]
        sizes = [p.numel() for p in parts]
        offsets, total = pack_layout(sizes, dtype.itemsize)
        staging = torch.empty(total, dtype=dtype, pin_memory=True)
        torch.cat(_with_padding(parts, offsets, total, dtype), out=staging)
        flat = staging.to(device, non_blocking=True)  # a fresh allocation: aligned
        for i, off, n in zip(idx, offsets, sizes):
            out[i] = flat[off : off + n].view(tensors[i].shape)  # type: ignore[union-attr]
    return out


def pack_layout(sizes: Sequence[int], itemsize: int) -> tuple[list[int], int]:
    """Element offsets of parts of ``sizes`` elements packed back to back, each starting at a
    multiple of :data:`PACK_ALIGN_BYTES`; and the total length including the padding."""
    step = max(1, PACK_ALIGN_BYTES // itemsize)
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // step) * step
    return offsets, total


def _with_padding(
    parts: Sequence[torch.Tensor], offsets: Sequence[int], total: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """``parts`` interleaved with the zero runs that put each at its offset (one ``cat``)."""
    zeros = _ZEROS.get(dtype)
    if zeros is None:
        zeros = _ZEROS[dtype] = torch.zeros(max(1, PACK_ALIGN_BYTES // dtype.itemsize), dtype=dtype)
    out = []
    ends = [*offsets[1:], total]
    for p, off, end in zip(parts, offsets, ends):
        out.append(p)
        if end - off - p.numel():
            out.append(zeros[: end - off - p.numel()])
    return out
