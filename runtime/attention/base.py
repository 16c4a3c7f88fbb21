"""The attention backend interface (docs/design.md §5).

A backend reads and writes the paged KV pool. Per forward pass the model runner calls
:meth:`AttentionBackend.init_metadata` once; then every attention layer calls
:meth:`AttentionBackend.forward`, which dispatches on the batch's mode. Shapes::

    q: [T, num_heads, head_dim]    k, v: [T, num_kv_heads, head_dim]    out: [T, num_heads, head_dim]

where ``T`` is the number of new tokens in the batch (flat, requests back to back).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from phloem.runtime.forward_io import ForwardMode
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from phloem.runtime.cache.host_pool import LayerReadiness
    from phloem.runtime.cache.kv_pool import KVPool, ReqToTokenPool
    from phloem.runtime.forward_io import ForwardInput

__all__ = ["AttentionBackend", "QKNorm"]


class QKNorm(NamedTuple):
    """Per-head RMSNorm of q and k before RoPE (Qwen3): weights ``[head_dim]`` and epsilon."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The unfused norms: new ``q`` and ``k`` tensors."""
        from phloem.runtime.layers.rmsnorm import rms_norm

        return rms_norm(q, self.q_weight, self.eps), rms_norm(k, self.k_weight, self.eps)


class AttentionBackend(ABC):
    """Paged attention over a :class:`KVPool` addressed through ``req_to_token``.

    Parameters
    ----------
    kv_pool, req_to_token_pool:
        Shared with the model runner; the backend writes new K/V into ``kv_pool``.
    num_heads:
        Query heads (the pool knows the KV heads and head size).
    """

    # Set by the model runner for the forward pass of a batch whose cached prefix is still arriving
    # from the host tier, layer by layer (``LayerwiseLoader``); ``None`` when nothing is pending.
    layer_ready: LayerReadiness | None = None

    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool, *, num_heads: int) -> None:
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.num_heads = num_heads
        self.scale = kv_pool.head_dim**-0.5
        self.mode = ForwardMode.IDLE

    @abstractmethod
    def init_metadata(self, forward_input: ForwardInput) -> None:
        """Prepare per-batch indices for ``forward_input`` (already on the backend's device).

        Replaces the previous batch's metadata; valid until the next call. Reads
        ``req_to_token`` as it is now, so the scheduler must have written this batch's slots.
        """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        """Attention of layer ``layer`` for the current batch; writes ``k``/``v`` at ``out_slots``.
        With ``cos_sin`` (RoPE tables of the batch's positions, ``[T, 1, D/2]`` each) ``q`` and
        ``k`` are rotated here first, so a backend may fuse the rotation with the K/V write; with
        ``qk_norm`` they are normalized per head before that (fused with it where the backend can)."""
        if self.layer_ready is not None:
            self.layer_ready.wait(layer)  # this layer's loaded KV is in the pool before we read or write it
        if cos_sin is not None:
            q, k = self.rotate(q, k, v, cos_sin, layer, qk_norm)
        elif qk_norm is not None:
            q, k = qk_norm.apply(q, k)
        if self.mode == ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer)
        if self.mode == ForwardMode.EXTEND:
            return self.forward_extend(q, k, v, layer)
        if self.mode == ForwardMode.TARGET_VERIFY:
            return self.forward_verify(q, k, v, layer)
        raise RuntimeError(f"attention called in mode {self.mode!r}; call init_metadata first")

    def rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        layer: int,
        qk_norm: QKNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on ``q`` and ``k``, after ``qk_norm`` if given (returns the rotated pair; they may
        be the inputs, rotated in place). A backend that also writes ``k``/``v`` to the pool here
        must then skip that write."""
        from phloem.runtime.layers.rotary import RotaryEmbedding

        if qk_norm is not None:
            q, k = qk_norm.apply(q, k)
        return RotaryEmbedding.apply(q, k, cos_sin)

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """Ragged new tokens attending causally to their request's cached prefix and to each other.

        Writes the new ``k``/``v`` into the pool at the batch's ``out_slots`` first. Token ``t`` of
        request ``r`` (at position ``prefix_lens[r] + i``) sees slots
        ``req_to_token[r, 0 : prefix_lens[r] + i + 1]``.
        """

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """One query per request over ``req_to_token[r, 0 : seq_lens[r]]`` (its own K/V included).

        Writes the new ``k``/``v`` at ``out_slots`` first.
        """

    def forward_verify(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """Draft-tree verification with a tree mask (speculative decoding).

        Request ``r`` has ``extend_lens[r]`` tree nodes (``tree_parents[r]``); node ``i`` sees
        ``req_to_token[r, 0 : prefix_lens[r]]``, then the ``out_slots`` of its ancestors and itself.
        Writes the new ``k``/``v`` at ``out_slots`` first.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support tree verification yet")


# cuDNN's SDPA builds and caches an execution plan for every new shape, which costs far more than
# the attention itself and is paid at every step whose key length is new. Callers whose shapes
# change from step to step (EAGLE drafting, the per-request reference paths) choose among the
# other kernels.
_VARYING_SHAPE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def varying_shape_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None, **kw: Any
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` without the cuDNN backend on CUDA (same result)."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kw)
    with sdpa_kernel(_VARYING_SHAPE_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kw)


def ancestor_mask(parents: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """The attention mask of a draft tree (``parents[i] < i``), bool ``[n, n]``: ``mask[i, j]`` is
    True when node ``j`` is ``i`` itself or an ancestor of ``i``.

    Equivalent loop::

        for i in range(n):
            j = i
            while j != -1:
                mask[i, j] = True
                j = parents[j]
    """
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        p = parents[i]
        if p >= 0:
            mask[i] = mask[p]  # a node sees what its parent sees ...
        mask[i, i] = True  # ... and itself
    return mask.to(device)
