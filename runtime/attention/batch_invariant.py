"""Batch-invariant attention (deterministic mode, docs/design.md §5): every query row on its own.

A token's attention output must not depend on the batch it ran in: not on the other requests,
not on whether its request was extending (prefill, chunked prefill, extend over a cached prefix)
or decoding. Here each query row attends over exactly its own keys with one call whose shapes
and strides depend only on the row's position::

    for each request r, keys = pool[req_to_token[r, :seq_len]]        # [S, Hk, D]
        for each new token at position p:
            out[t] = sdpa(q[t] [1, Hq, 1, D], keys[:p + 1], values[:p + 1])    # float32

``keys[:L]`` of a gathered ``[S, Hk, D]`` tensor has the same strides for any ``S``, so a decode
step (``S = L``) and an extend row (``S > L``) make the same call. Slower than ``torch_ref``
(one call per token and layer): the price of results that do not depend on the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from phloem.runtime.attention.base import AttentionBackend

if TYPE_CHECKING:
    from phloem.runtime.forward_io import ForwardInput

__all__ = ["BatchInvariantBackend"]


class BatchInvariantBackend(AttentionBackend):
    """One float32 attention call per query row (see module docstring)."""

    def init_metadata(self, forward_input: ForwardInput) -> None:
        fi = forward_input
        self.mode = fi.mode
        self.out_slots = fi.out_slots
        rows = self.req_to_token_pool.req_to_token[fi.req_pool_indices]  # [B, max_context]
        # per request: (first flat token, its slots [S], key counts of its new tokens)
        self.plan: list[tuple[int, torch.Tensor, range]] = []
        start = 0
        for r, (p, e) in enumerate(zip(fi.prefix_lens.tolist(), fi.extend_lens.tolist())):
            if e:
                self.plan.append((start, rows[r, : p + e], range(p + 1, p + e + 1)))
            start += e

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        self.kv_pool.set_kv(layer, self.out_slots, k, v)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        qf = q.float()
        for start, slots, key_counts in self.plan:
            keys, values = self.kv_pool.gather_kv(layer, slots, torch.float32)  # [S, Hk, D], dequantized
            keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # [1, Hk, S, D]
            for i, n in enumerate(key_counts):
                o = F.scaled_dot_product_attention(
                    qf[start + i][None, :, None],  # [1, Hq, 1, D]
                    keys[:, :, :n],
                    values[:, :, :n],
                    scale=self.scale,
                    enable_gqa=True,
                )
                out[start + i] = o[0, :, 0]
        return out.to(q.dtype)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return self._attend(q, k, v, layer)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return self._attend(q, k, v, layer)
