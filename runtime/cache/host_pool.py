"""Host tier of the KV cache (DESIGN.md §3, HiCache): a host-memory copy of the device pool's layout.

``HostKVPool`` holds, per layer, K and V tensors ``[num_slots, kv_heads, head_dim]`` in host memory
(pinned when the device pool is on CUDA), with its own slot allocator; slot 0 is never handed out,
as in the device pool. ``KVCopier`` moves tokens between the two pools, one layer at a time:

    to_host:    host.k[l][host_slots] = device.k[l][dev_slots]   (and V), for every layer l
    to_device:  device.k[l][dev_slots] = host.k[l][host_slots]   (and V), for every layer l

On CPU these are plain indexed copies. ``CudaStreamCopier`` issues the same copies on a side stream
so that a caller can overlap them with compute; today it waits for the stream before returning
(``on_layer`` is the hook where a layer-by-layer load would signal the forward pass).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .allocator import TokenSlotAllocator
from .kv_pool import KVPool

__all__ = ["CudaStreamCopier", "HostKVPool", "KVCopier", "make_copier"]


class HostKVPool:
    """Per-layer K and V buffers in host memory plus the allocator of their slots.

    Parameters
    ----------
    num_layers, num_tokens, num_kv_heads, head_dim, dtype:
        Shape; ``num_tokens`` usable slots (slot 0 is extra and unused).
    pin_memory:
        Page-lock the buffers (for asynchronous copies to and from a CUDA device).
    check:
        Passed to the slot allocator (double-free detection, for tests).
    """

    def __init__(
        self,
        num_layers: int,
        num_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        pin_memory: bool = False,
        check: bool = False,
    ) -> None:
        if num_tokens < 1:
            raise ValueError(f"the host pool needs at least one token, got {num_tokens}")
        self.num_layers, self.num_slots = num_layers, num_tokens + 1
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (self.num_slots, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, pin_memory=pin_memory) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, pin_memory=pin_memory) for _ in range(num_layers)]
        self.allocator = TokenSlotAllocator(self.num_slots, check=check)

    @classmethod
    def like(cls, device_pool: KVPool, num_tokens: int, *, check: bool = False) -> HostKVPool:
        """A host pool with ``device_pool``'s layer shape and dtype, ``num_tokens`` slots."""
        return cls(
            device_pool.num_layers,
            num_tokens,
            device_pool.num_kv_heads,
            device_pool.head_dim,
            device_pool.dtype,
            pin_memory=device_pool.device.type == "cuda" and torch.cuda.is_available(),
            check=check,
        )

    @property
    def size(self) -> int:
        """Usable slots."""
        return self.allocator.total_size

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers."""
        return KVPool.bytes_per_token_for(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh copies of the K and V at ``slots``, each ``[layers, T, kv_heads, head_dim]``."""
        return (
            torch.stack([k[slots] for k in self.k_buffer]),
            torch.stack([v[slots] for v in self.v_buffer]),
        )

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` ``[layers, T, kv_heads, head_dim]`` at ``slots`` ``[T]`` (in place)."""
        for layer in range(self.num_layers):
            self.k_buffer[layer][slots] = k[layer].to(self.dtype)
            self.v_buffer[layer][slots] = v[layer].to(self.dtype)


class KVCopier:
    """Copies tokens between a device ``KVPool`` and a ``HostKVPool``, layer by layer (CPU path).

    ``on_layer(layer)``, when given, is called after each layer's copy to the device (the hook
    for a forward pass that consumes loaded layers while later ones are still moving).
    """

    def __init__(self, *, on_layer: Callable[[int], None] | None = None) -> None:
        self.on_layer = on_layer

    def to_host(
        self, device: KVPool, dev_slots: torch.Tensor, host: HostKVPool, host_slots: torch.Tensor
    ) -> None:
        """Copy device ``dev_slots`` into host ``host_slots`` (both int64 ``[T]``). Done on return."""
        d = dev_slots.to(device.device)
        for layer in range(device.num_layers):
            host.k_buffer[layer][host_slots] = device.k_buffer[layer][d].to("cpu")
            host.v_buffer[layer][host_slots] = device.v_buffer[layer][d].to("cpu")

    def to_device(
        self, host: HostKVPool, host_slots: torch.Tensor, device: KVPool, dev_slots: torch.Tensor
    ) -> None:
        """Copy host ``host_slots`` into device ``dev_slots``. Done (visible to the forward) on return."""
        d = dev_slots.to(device.device)
        for layer in range(device.num_layers):
            device.k_buffer[layer][d] = host.k_buffer[layer][host_slots].to(device.device)
            device.v_buffer[layer][d] = host.v_buffer[layer][host_slots].to(device.device)
            if self.on_layer is not None:
                self.on_layer(layer)


class CudaStreamCopier(KVCopier):
    """The same copies issued on a dedicated CUDA stream, from pinned host memory."""

    def __init__(self, device: torch.device, *, on_layer: Callable[[int], None] | None = None) -> None:
        super().__init__(on_layer=on_layer)
        self.stream = torch.cuda.Stream(device=device)

    def to_host(
        self, device: KVPool, dev_slots: torch.Tensor, host: HostKVPool, host_slots: torch.Tensor
    ) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(device.device))
        with torch.cuda.stream(self.stream):
            super().to_host(device, dev_slots, host, host_slots)
        self.stream.synchronize()

    def to_device(
        self, host: HostKVPool, host_slots: torch.Tensor, device: KVPool, dev_slots: torch.Tensor
    ) -> None:
        with torch.cuda.stream(self.stream):
            d = dev_slots.to(device.device, non_blocking=True)
            for layer in range(device.num_layers):
                k = host.k_buffer[layer][host_slots].pin_memory().to(device.device, non_blocking=True)
                v = host.v_buffer[layer][host_slots].pin_memory().to(device.device, non_blocking=True)
                device.k_buffer[layer][d] = k
                device.v_buffer[layer][d] = v
                if self.on_layer is not None:
                    self.on_layer(layer)
        self.stream.synchronize()


def make_copier(device_pool: KVPool) -> KVCopier:
    """The copier for ``device_pool``'s device, chosen once."""
    if device_pool.device.type == "cuda":
        return CudaStreamCopier(device_pool.device)
    return KVCopier()
