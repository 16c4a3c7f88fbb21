"""Attention of draft queries over the draft head's own cache, without copying it.

A query of the draft head (catch-up after a verify, or one level of a chain) reads the keys of
one draft-cache row, from position 0 up to a per-query limit::

    out[b, i] = softmax(q[b, i] . K[rows[b], :limits[b, i]]^T * D**-0.5) . V[rows[b], :limits[b, i]]

The cache (:class:`~phloem.runtime.speculative.eagle.DraftKVCache`) is dense ``[rows, length, Hk,
D]``. Viewed as a token pool of ``rows * length`` slots with the table ``slots[r, j] = r * length
+ j``, every query is one "request" of the target's split-KV decode kernel
(:func:`~phloem.runtime.attention.triton_kernels.decode_attention`): no copy of the row, no
repeat of the KV heads for their query heads, no mask tensor, and the key count is read on the
device (a CUDA graph serves every context length).

The reference (:func:`attend_reference`) gathers the rows and masks them; it runs off CUDA and is
the oracle of the kernel path in the tests.
"""

from __future__ import annotations

import torch
from phloem.runtime.attention.base import varying_shape_sdpa
from phloem.runtime.layers.fusion import use_fused

__all__ = ["attend_kernel", "attend_reference", "draft_attend", "uses_kernel"]


def draft_attend(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    limits: torch.Tensor,
    max_keys: int,
) -> torch.Tensor:
    """``q`` ``[B, M, Hq, D]`` over the cache rows ``rows`` ``[B]`` (``k_store``, ``v_store``
    ``[R, L, Hk, D]``, ``slots`` their ``[R, L]`` slot table); query ``(b, i)`` sees keys
    ``0 .. limits[b, i] - 1`` (``1 <= limits <= L``). ``max_keys`` bounds the limits of real
    queries; only the reference reads it. Returns ``[B, M, Hq, D]``."""
    if uses_kernel(q):
        return attend_kernel(q, k_store, v_store, slots, rows, limits)
    return attend_reference(q, k_store, v_store, rows, limits, max_keys)


def uses_kernel(x: torch.Tensor) -> bool:
    """Whether :func:`draft_attend` takes the kernel for queries like ``x`` (CUDA, fused kernels
    on, 16-bit): then it reads no ``max_keys``, and a captured pass serves every key width."""
    return use_fused(x) and x.dtype in (torch.float16, torch.bfloat16)


def attend_kernel(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    limits: torch.Tensor,
) -> torch.Tensor:
    """:func:`draft_attend` through the split-KV decode kernel (module docstring)."""
    from phloem.runtime.attention.triton_kernels import decode_attention, decode_scratch

    b, m, hq, d = q.shape
    r, n, hk, _ = k_store.shape
    flat_q = q.reshape(b * m, hq, d)
    if flat_q.stride(-1) != 1:
        flat_q = flat_q.contiguous()
    out = q.new_empty((b * m, hq, d))
    part_o, part_lse = decode_scratch(b * m, hq, hk, d, q.device)
    decode_attention(
        flat_q, k_store.view(r * n, hk, d), v_store.view(r * n, hk, d), out, part_o, part_lse,
        req_to_token=slots, req_pool_indices=rows.repeat_interleave(m), seq_lens=limits.reshape(-1),
        sm_scale=d**-0.5,
    )  # fmt: skip
    return out.view(b, m, hq, d)


def attend_reference(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    rows: torch.Tensor,
    limits: torch.Tensor,
    max_keys: int,
) -> torch.Tensor:
    """:func:`draft_attend` in torch: the first ``max_keys`` entries of each row, KV heads
    repeated for their query heads, a boolean mask from ``limits``."""
    hq, hk = q.shape[2], k_store.shape[2]
    width = min(max_keys, k_store.shape[1])

    def gather(store: torch.Tensor) -> torch.Tensor:  # [B, Hq, W, D]
        return store[rows, :width].transpose(1, 2).repeat_interleave(hq // hk, dim=1)

    mask = torch.arange(width, device=q.device) < limits[..., None]  # [B, M, W]
    o = varying_shape_sdpa(q.transpose(1, 2), gather(k_store), gather(v_store), attn_mask=mask[:, None])
    return o.transpose(1, 2)
