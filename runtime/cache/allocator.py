"""Token-slot allocator: hands out KV pool slots, one slot per token.

Slot 0 is the pool's padding slot (padded rows of a batch write their KV there); it is never handed
out. Slots ``1 .. num_slots - 1`` are usable, so ``total_size == num_slots - 1``.

Free slots live in one int64 tensor consumed from the front, plus a list of freed chunks that is
concatenated onto it only when an allocation needs more than the front holds. ``alloc(n)`` is O(n)
in the common case, ``free(slots)`` is O(len(slots)). Freed device slots (rows of the device-side
``req_to_token``) are copied back asynchronously; a chunk's event is awaited only at that merge.
"""

from __future__ import annotations

from typing import Any

import torch
from phloem.runtime.host_copy import to_host_async

__all__ = ["SlotAllocatorError", "TokenSlotAllocator"]

PADDING_SLOT = 0


class SlotAllocatorError(RuntimeError):
    """A slot was freed twice, or a slot outside the pool was freed (raised only in check mode)."""


class TokenSlotAllocator:
    """Free list of KV pool slots (CPU int64 tensors).

    Parameters
    ----------
    num_slots:
        Size of the KV pool in slots, padding slot included.
    check:
        Keep a per-slot "is free" bitmap and reject double frees, out-of-range slots and the padding
        slot in ``free``. Costs one bool per slot and O(len) tensor work per call; tests turn it on.
    """

    def __init__(self, num_slots: int, *, check: bool = False) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1 (slot 0 is padding), got {num_slots}")
        self._num_slots = num_slots
        self._check = check
        self.reset()

    def reset(self) -> None:
        """Mark every usable slot free. Mutates all state; earlier ``alloc`` results become stale."""
        self._free = torch.arange(1, self._num_slots, dtype=torch.int64)
        self._pending: list[torch.Tensor] = []
        self._pending_ready: list[Any] = []  # per pending chunk: its copy's event, or None
        self._pending_size = 0
        self._is_free: torch.Tensor | None = None
        if self._check:
            self._is_free = torch.ones(self._num_slots, dtype=torch.bool)
            self._is_free[PADDING_SLOT] = False

    @property
    def total_size(self) -> int:
        """Number of usable slots (``num_slots - 1``)."""
        return self._num_slots - 1

    @property
    def available_size(self) -> int:
        """Number of free slots right now."""
        return self._free.numel() + self._pending_size

    @property
    def check(self) -> bool:
        """Whether double frees are detected."""
        return self._check

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take ``n`` free slots; ``None`` (and no change) when fewer than ``n`` are free.

        Mutates the free list. The returned int64 tensor of shape ``[n]`` is never written by the
        allocator, so it stays valid until the caller frees the slots.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self.available_size:
            return None
        if n > self._free.numel():
            self._merge_pending()
        out, self._free = self._free[:n], self._free[n:]
        if self._is_free is not None:
            self._is_free[out] = False
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Return ``slots`` (int64, any shape) to the free list.

        Mutates the free list; in check mode raises ``SlotAllocatorError`` (and frees nothing) on a
        slot that is already free, repeated, out of range, or the padding slot. The allocator keeps a
        flattened copy, so the caller may reuse ``slots`` afterwards.
        """
        if slots.numel() == 0:
            return
        if self._is_free is None:
            # Device slots come back without waiting for the stream (``to_host_async``); the
            # chunk is usable once its copy has landed, checked when pending chunks are merged.
            flat, ready = to_host_async(slots)
        else:
            flat, ready = slots.detach().reshape(-1).to(device="cpu", dtype=torch.int64).clone(), None
            self._validate_free(flat)
            self._is_free[flat] = True
        self._pending.append(flat)
        self._pending_ready.append(ready)
        self._pending_size += flat.numel()

    def free_slots(self) -> torch.Tensor:
        """All free slots as one int64 tensor (for integrity checks).

        Merges pending chunks (mutates internal layout only). The result is a fresh copy.
        """
        self._merge_pending()
        return self._free.clone()

    def _merge_pending(self) -> None:
        if self._pending:
            for ready in self._pending_ready:
                if ready is not None:
                    ready.synchronize()  # the slot numbers of a device-side free have landed
            self._free = torch.cat([self._free, *self._pending])
            self._pending = []
            self._pending_ready = []
            self._pending_size = 0

    def _validate_free(self, flat: torch.Tensor) -> None:
        assert self._is_free is not None
        bad_range = (flat <= PADDING_SLOT) | (flat >= self._num_slots)
        if bool(bad_range.any()):
            raise SlotAllocatorError(
                f"slots out of range 1..{self._num_slots - 1}: {flat[bad_range].tolist()}"
            )
        already = self._is_free[flat]
        if bool(already.any()):
            raise SlotAllocatorError(f"double free of slots {flat[already].tolist()}")
        if torch.unique(flat).numel() != flat.numel():
            raise SlotAllocatorError("the same slot appears twice in one free() call")

    def __repr__(self) -> str:
        return f"TokenSlotAllocator(free={self.available_size}/{self.total_size}, check={self._check})"
