"""Triton paged attention: the default CUDA backend (kernels in ``triton_kernels.py``).

``init_metadata`` does device work only (no host sync), so a decode batch can be captured in a
CUDA graph: the tensors it keeps are views of the forward input, and the decode scratch depends on
the batch size alone. Extend builds a per-batch table of (request, query block) on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from phloem.runtime import switches
from phloem.runtime.attention.base import AttentionBackend, QKNorm
from phloem.runtime.attention.triton_extend_contig import (
    contiguous_extend_ok,
    extend_attention_contiguous,
    extend_tiles,
)
from phloem.runtime.attention.triton_kernels import (
    NewTokenKV,
    decode_attention,
    decode_scratch,
    extend_attention,
    extend_block_table,
)
from phloem.runtime.forward_io import ForwardMode
from phloem.runtime.layers.fused_triton import rope_store_
from phloem.runtime.layers.fusion import use_fused

if TYPE_CHECKING:
    from phloem.runtime.forward_io import ForwardInput

__all__ = ["ROPE_IN_DECODE", "TritonBackend"]

# Decode passes rotate q and k and write the new K/V inside the decode kernel (``NewTokenKV``)
# rather than in ``rope_store_`` before it; ``PHLOEM_DECODE_ROPE=0`` keeps the separate kernel
# (A/B measurement). Read when a backend is built; a captured graph keeps the path it was captured
# with. ``None`` reads the switch; tests set True or False before building a backend.
ROPE_IN_DECODE: bool | None = None


class TritonBackend(AttentionBackend):
    """Paged extend and split-KV decode in Triton (see module docstring)."""

    supports_cuda_graph = True
    _stored_layer = -1  # layer whose new K/V ``rotate`` already wrote (fused with RoPE)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rope_in_decode = ROPE_IN_DECODE if ROPE_IN_DECODE is not None else switches.DECODE_ROPE.flag()
    _contig = False  # whether that ``rotate`` also left k rotated in place, for the contiguous kernel
    _new_kv: NewTokenKV | None = None  # a decode layer's token, for the decode kernel to rotate and store
    key_pairs: tuple[int, int] | None = None  # the extend batch's (prefix, new) query-key pairs

    def init_metadata(self, forward_input: ForwardInput) -> None:
        fi = forward_input
        self.mode = fi.mode
        self.out_slots = fi.out_slots
        self.req_pool_indices = fi.req_pool_indices
        if fi.mode == ForwardMode.DECODE:
            self.seq_lens = fi.seq_lens
            self._init_decode_scratch(fi.batch_size, fi.seq_lens.device)
        else:
            self.prefix_lens, self.extend_lens = fi.prefix_lens, fi.extend_lens
            self.q_start = torch.cumsum(fi.extend_lens, 0) - fi.extend_lens  # [B] exclusive
            self.block_req, self.block_m = extend_block_table(fi.extend_lens, fi.num_tokens)
            self.key_pairs = fi.host_key_pairs()

    def _init_decode_scratch(self, batch: int, device: torch.device) -> None:
        # Shared by every layer of this batch; each layer overwrites all of it.
        self.part_o, self.part_lse = decode_scratch(
            batch, self.num_heads, self.kv_pool.num_kv_heads, self.kv_pool.head_dim, device
        )

    def rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        layer: int,
        qk_norm: QKNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel (per-head norms first, with ``qk_norm``) rotates q in place and writes
        rotated k and v to the pool, quantized for an fp8 pool (the torch reference path takes
        the unfused route). An extend pass that the contiguous-K/V kernel will serve
        (``triton_extend_contig``) also rotates k in place, for that kernel reads the new keys from
        it; otherwise k is left as it came. A decode pass (with :data:`ROPE_IN_DECODE`) launches
        nothing here: q and k come back as they came, and the decode kernel rotates them and
        writes the new K/V (``triton_kernels.NewTokenKV``)."""
        k_buf, v_buf = self.kv_pool.get_kv(layer)
        fusable = (
            self.mode in (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY)
            and use_fused(q)
            and k_buf.dtype in (k.dtype, torch.float8_e4m3fn)
            and all(x.stride(-1) == 1 for x in (q, k, v))
        )
        if not fusable:
            return super().rotate(q, k, v, cos_sin, layer, qk_norm)
        if self.mode == ForwardMode.DECODE and self._rope_in_decode:
            # left to the decode kernel (``NewTokenKV``): q and k stay as they are for now
            cos, sin = cos_sin
            norm = None if qk_norm is None else (qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps)
            self._new_kv = NewTokenKV(k, v, cos, sin, self.out_slots, norm)
            self._stored_layer = layer
            return q, k
        k_scale, v_scale = self.kv_pool.get_kv_scales(layer)
        contig = self.mode == ForwardMode.EXTEND and contiguous_extend_ok(q, k, v, k_buf)
        rope_store_(
            q, k, v, *cos_sin, k_buf, v_buf, self.out_slots, qk_norm=qk_norm, k_scale=k_scale, v_scale=v_scale,
            k_inplace=contig,
        )  # fmt: skip
        self._stored_layer = layer
        self._contig = contig
        return q, k

    def _store(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> None:
        if self._stored_layer != layer:
            self.kv_pool.set_kv(layer, self.out_slots, k, v)
        self._stored_layer = -1

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        fused = self._stored_layer == layer
        self._store(k, v, layer)
        k_buf, v_buf = self.kv_pool.get_kv(layer)
        k_scale, v_scale = self.kv_pool.get_kv_scales(layer)
        out = q.new_empty(q.shape)
        # a fused rotate already chose (and rotated k in place for it): the same answer, decided once
        contig = self._contig if fused else contiguous_extend_ok(q, k, v, k_buf)
        if contig:  # new keys read from k, v; the prefix from the pool
            block_n, block_prefix = extend_tiles(self.key_pairs)
            return extend_attention_contiguous(
                q, k, v, k_buf, v_buf, out,
                req_to_token=self.req_to_token_pool.req_to_token,
                req_pool_indices=self.req_pool_indices,
                prefix_lens=self.prefix_lens, extend_lens=self.extend_lens, q_start=self.q_start,
                block_req=self.block_req, block_m=self.block_m, sm_scale=self.scale,
                block_n=block_n, block_prefix=block_prefix,
            )  # fmt: skip
        return extend_attention(
            q, k_buf, v_buf, out,
            req_to_token=self.req_to_token_pool.req_to_token,
            req_pool_indices=self.req_pool_indices,
            prefix_lens=self.prefix_lens, extend_lens=self.extend_lens, q_start=self.q_start,
            block_req=self.block_req, block_m=self.block_m, sm_scale=self.scale,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        new_kv = self._new_kv if self._stored_layer == layer else None
        self._new_kv = None
        self._store(k, v, layer)
        k_buf, v_buf = self.kv_pool.get_kv(layer)
        k_scale, v_scale = self.kv_pool.get_kv_scales(layer)
        out = q.new_empty(q.shape)
        return decode_attention(
            q, k_buf, v_buf, out, self.part_o, self.part_lse,
            req_to_token=self.req_to_token_pool.req_to_token,
            req_pool_indices=self.req_pool_indices, seq_lens=self.seq_lens, sm_scale=self.scale,
            k_scale=k_scale, v_scale=v_scale, new_kv=new_kv,
        )  # fmt: skip
