"""Reference attention in plain torch: the oracle every fast backend is tested against.

Also the CPU backend. Extend loops over requests (one ``scaled_dot_product_attention`` call each,
keys gathered from the pool through ``req_to_token``); decode gathers every request's slots into
one padded ``[B, max_len]`` block and runs a single masked call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from phloem.runtime.attention.base import AttentionBackend, ancestor_mask
from phloem.runtime.cache.kv_pool import PADDING_SLOT
from phloem.runtime.forward_io import ForwardMode

if TYPE_CHECKING:
    from phloem.runtime.forward_io import ForwardInput

__all__ = ["TorchRefBackend"]


class TorchRefBackend(AttentionBackend):
    """Plain-torch paged attention (see module docstring)."""

    def init_metadata(self, forward_input: ForwardInput) -> None:
        fi = forward_input
        self.mode = fi.mode
        self.out_slots = fi.out_slots
        rows = self.req_to_token_pool.req_to_token[fi.req_pool_indices]  # [B, max_context]
        if fi.mode == ForwardMode.DECODE:
            self._init_decode(rows, fi.seq_lens)
        elif fi.mode == ForwardMode.TARGET_VERIFY:
            self._init_verify(rows, fi)
        else:
            self._init_extend(rows, fi)

    def _init_decode(self, rows: torch.Tensor, seq_lens: torch.Tensor) -> None:
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
        cols = torch.arange(max_len, device=rows.device)
        valid = cols[None, :] < seq_lens[:, None]  # [B, L]
        self.decode_slots = torch.where(valid, rows[:, :max_len], PADDING_SLOT)
        self.decode_mask = valid[:, None, None, :]  # [B, 1, 1, L] broadcast over heads and query

    def _init_extend(self, rows: torch.Tensor, fi: ForwardInput) -> None:
        prefix, extend = fi.prefix_lens.tolist(), fi.extend_lens.tolist()
        self.extend_plan: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        start = 0
        for r, (p, e) in enumerate(zip(prefix, extend)):
            if e == 0:
                continue
            q_pos = torch.arange(p, p + e, device=rows.device)
            mask = torch.arange(p + e, device=rows.device)[None, :] <= q_pos[:, None]  # [e, p + e]
            self.extend_plan.append((start, e, rows[r, : p + e], mask[None, None]))  # [1, 1, e, S]
            start += e

    def _init_verify(self, rows: torch.Tensor, fi: ForwardInput) -> None:
        assert fi.tree_parents is not None, "TARGET_VERIFY needs tree_parents"
        prefix, extend = fi.prefix_lens.tolist(), fi.extend_lens.tolist()
        self.extend_plan = []
        start = 0
        for r, (p, e) in enumerate(zip(prefix, extend)):
            keys = torch.cat([rows[r, :p], fi.out_slots[start : start + e]])  # [p + e]
            seen = torch.ones(e, p, dtype=torch.bool, device=rows.device)
            mask = torch.cat([seen, ancestor_mask(fi.tree_parents[r], rows.device)], dim=1)  # [e, p + e]
            self.extend_plan.append((start, e, keys, mask[None, None]))
            start += e

    def forward_verify(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return self.forward_extend(q, k, v, layer)  # same per-request loop, tree masks planned

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        self.kv_pool.set_kv(layer, self.out_slots, k, v)
        out = torch.empty_like(q)
        # 4-D operands with a 4-D mask take torch's fused CPU kernel, which 3-D operands miss.
        for start, e, slots, mask in self.extend_plan:
            q_r = q[start : start + e].transpose(0, 1)[None]  # [1, Hq, e, D]
            k_s, v_s = self.kv_pool.gather_kv(layer, slots, q.dtype)  # [S, Hk, D], dequantized
            o = F.scaled_dot_product_attention(
                q_r,
                k_s.transpose(0, 1)[None],  # [1, Hk, S, D]
                v_s.transpose(0, 1)[None],
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=True,
            )
            out[start : start + e] = o[0].transpose(0, 1)  # [e, Hq, D]
        return out

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        self.kv_pool.set_kv(layer, self.out_slots, k, v)
        k_all, v_all = self.kv_pool.gather_kv(layer, self.decode_slots, q.dtype)  # [B, L, Hk, D]
        k_all, v_all = k_all.transpose(1, 2), v_all.transpose(1, 2)  # [B, Hk, L, D]
        q_b = q.unsqueeze(2)  # [B, Hq, 1, D]
        o = F.scaled_dot_product_attention(
            q_b, k_all, v_all, attn_mask=self.decode_mask, scale=self.scale, enable_gqa=True
        )
        return o.squeeze(2)  # [B, Hq, D]
