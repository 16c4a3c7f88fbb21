"""Device-side KV storage (DESIGN.md §3): one slot per token, addressed through ``req_to_token``.

``KVPool`` holds, per layer, K and V tensors ``[num_slots, kv_heads, head_dim]``. Slot 0 is the
padding slot: padded rows of a batch write there and it is never handed out by the allocator.
``ReqToTokenPool`` maps ``(request row, position) -> slot``; requests sharing a prefix hold the
same slot numbers in their rows.
"""

from __future__ import annotations

import torch

__all__ = ["PADDING_SLOT", "KVPool", "ReqToTokenPool"]

PADDING_SLOT = 0


class KVPool:
    """Per-layer K and V buffers.

    Parameters
    ----------
    num_layers, num_slots, num_kv_heads, head_dim:
        Shape; ``num_slots`` includes the padding slot 0, so ``num_slots - 1`` tokens fit.
    dtype, device:
        Storage dtype and device.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is padding), got {num_slots}")
        self.num_layers, self.num_slots = num_layers, num_slots
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def size(self) -> int:
        """Usable slots (padding slot excluded)."""
        return self.num_slots - 1

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers."""
        return self.bytes_per_token_for(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @staticmethod
    def bytes_per_token_for(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """``kv_heads x head_dim x 2 (K and V) x layers x dtype size``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_kv_heads * head_dim * 2 * num_layers * itemsize

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v`` ``[T, kv_heads, head_dim]`` at ``slots`` ``[T]`` of ``layer`` (in place)."""
        self.k_buffer[layer][slots] = k.to(self.dtype)
        self.v_buffer[layer][slots] = v.to(self.dtype)

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K and V buffers of ``layer`` (views, valid until the pool is freed)."""
        return self.k_buffer[layer], self.v_buffer[layer]


class ReqToTokenPool:
    """Rows of ``req_to_token`` ``[size, max_context_len]`` (int64), one row per running request.

    Rows are handed out by :meth:`alloc` and returned by :meth:`free`; a row's content is owned by
    the scheduler/cache manager, which writes slot numbers into it before each forward.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        self.size, self.max_context_len = size, max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self._free_rows = list(range(size - 1, -1, -1))  # pop() hands out row 0 first

    @property
    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row index, or ``None`` when all rows are in use."""
        return self._free_rows.pop() if self._free_rows else None

    def free(self, idx: int) -> None:
        """Return row ``idx``; its content is left as is and must not be read afterwards."""
        if not 0 <= idx < self.size:
            raise ValueError(f"row {idx} is outside the pool of {self.size}")
        self._free_rows.append(idx)

    def clear(self) -> None:
        """Free every row."""
        self._free_rows = list(range(self.size - 1, -1, -1))
