"""Host-to-device copies that never stall the host (DESIGN.md §5, the overlap loop).

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

__all__ = ["pack_to_device", "to_device"]

# Host tensors at least this large and already pinned are copied on their own (packing would
# add a host copy of them).
_PACK_LIMIT = 1 << 16


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without blocking the host (``t`` itself when it is there already).

    A small host tensor always goes through a fresh pinned staging buffer: asking CUDA whether
    it is pinned already (``is_pinned``) costs more than copying it (about 0.1 ms a call under
    cProfile on the H200's host, paid for every admitted request)."""
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
        staging = torch.empty(sum(p.numel() for p in parts), dtype=dtype, pin_memory=True)
        torch.cat(parts, out=staging)
        flat = staging.to(device, non_blocking=True)
        offset = 0
        for i, p in zip(idx, parts):
            shape = tensors[i].shape  # type: ignore[union-attr]
            out[i] = flat[offset : offset + p.numel()].view(shape)
            offset += p.numel()
    return out
