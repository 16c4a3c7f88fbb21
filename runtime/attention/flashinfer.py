"""FlashInfer paged attention, used when the ``flashinfer`` package imports.

The KV pool is viewed as FlashInfer's paged cache with one token per page (``NHD`` layout,
``[num_slots, 1, kv_heads, head_dim]``), so the page table is just the request's slots from
``req_to_token``. Importing this module raises ``ImportError`` without FlashInfer; the registry then
falls back to another backend. FlashInfer's ``plan`` reads the index pointers on the host, so
``init_metadata`` synchronises once per batch (not per layer).

An fp8 KV pool is refused: FlashInfer would need the query dtype at ``plan`` time (the pool only
knows its storage dtype) and the per-layer scales at ``run``; use the ``triton`` backend for fp8.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import flashinfer  # noqa: F401  (ImportError here is the registry's signal to skip this backend)
import torch
from phloem.runtime.attention.base import AttentionBackend
from phloem.runtime.forward_io import ForwardMode

if TYPE_CHECKING:
    from phloem.runtime.cache.kv_pool import KVPool, ReqToTokenPool
    from phloem.runtime.forward_io import ForwardInput

__all__ = ["FlashInferBackend"]

_WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferBackend(AttentionBackend):
    """Paged extend and decode through FlashInfer's batch wrappers (see module docstring)."""

    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool, *, num_heads: int) -> None:
        if kv_pool.is_fp8:
            raise ValueError(
                f"the flashinfer attention backend does not read an fp8 KV cache ({kv_pool.dtype}); "
                "use --attention-backend triton (or torch_ref) with --kv-cache-dtype fp8_e4m3"
            )
        super().__init__(kv_pool, req_to_token_pool, num_heads=num_heads)
        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=kv_pool.device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def init_metadata(self, forward_input: ForwardInput) -> None:
        fi = forward_input
        self.mode = fi.mode
        self.out_slots = fi.out_slots
        rows = self.req_to_token_pool.req_to_token[fi.req_pool_indices]  # [B, max_context]
        valid = torch.arange(rows.shape[1], device=rows.device)[None, :] < fi.seq_lens[:, None]
        kv_indices = rows[valid].to(torch.int32)  # [sum(seq_lens)], request by request
        kv_indptr = _indptr(fi.seq_lens)
        last_page_len = torch.ones_like(fi.seq_lens, dtype=torch.int32)  # one token per page
        pool = self.kv_pool
        common = dict(q_data_type=pool.dtype, kv_data_type=pool.dtype, sm_scale=self.scale)
        if fi.mode == ForwardMode.DECODE:
            self._decode.plan(
                kv_indptr, kv_indices, last_page_len,
                self.num_heads, pool.num_kv_heads, pool.head_dim, 1, **common,
            )  # fmt: skip
        else:
            self._prefill.plan(
                _indptr(fi.extend_lens), kv_indptr, kv_indices, last_page_len,
                self.num_heads, pool.num_kv_heads, pool.head_dim, 1, causal=True, **common,
            )  # fmt: skip

    def _paged_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k_buf, v_buf = self.kv_pool.get_kv(layer)
        return k_buf.unsqueeze(1), v_buf.unsqueeze(1)  # [slots, page_size 1, Hk, D]

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        self.kv_pool.set_kv(layer, self.out_slots, k, v)
        return self._prefill.run(q.contiguous(), self._paged_kv(layer))

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        self.kv_pool.set_kv(layer, self.out_slots, k, v)
        return self._decode.run(q.contiguous(), self._paged_kv(layer))


def _indptr(lens: torch.Tensor) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as int32, ``[B + 1]``."""
    out = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    out[1:] = torch.cumsum(lens, 0)
    return out
