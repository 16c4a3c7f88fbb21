"""Padded tree passes on CUDA: Triton tree attention, CUDA graphs (docs/design.md §5, §7).

The speculative verify pass runs here, and so do short extends (``extend_graphs.py``: a
request's new tokens are a tree of one branch).

Every request's tree is padded to ``nodes`` (the step's largest tree), so a verify batch of ``B``
requests is always ``B * nodes`` tokens and its shapes depend on ``B`` alone. That makes it a
CUDA graph like a decode step: one graph per captured batch size (``capture_batch_sizes``), its
inputs copied into static buffers before a replay::

    input_ids, positions, node_slots  [max_bs * nodes]     the nodes, request after request
    req_pool_indices, prefix_lens     [max_bs]             each request's row and cached length
    tree_mask                         [max_bs, nodes, nodes]  ancestors-and-self, int8

Padding nodes (and the spare requests of a padded batch) write the padding slot, see only
themselves and are never read back. What a graph covers: the target model over all nodes, its
final hidden states (the EAGLE draft's features) and the logits of every node. Acceptance stays
on the host side of :class:`~phloem.runtime.speculative.verify.TreeVerifier`.

Batches larger than the largest graph run the same padded pass eagerly.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from phloem.runtime.attention.base import ancestor_mask
from phloem.runtime.attention.cpu import CpuRowsAttention
from phloem.runtime.attention.triton import TritonBackend
from phloem.runtime.attention.triton_verify import tree_verify_attention, tree_verify_reference
from phloem.runtime.cache.kv_pool import PADDING_SLOT
from phloem.runtime.executor.cuda_graph import capture_batch_sizes, capture_graphs
from phloem.runtime.forward_io import ForwardMode
from phloem.runtime.host_copy import pack_to_device, to_device

__all__ = ["CpuChainAttention", "TreeVerifyBackend", "VerifyGraphRunner"]

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=512)
def _ancestor_mask_i8(parents: tuple[int, ...]) -> torch.Tensor:
    """:func:`ancestor_mask` as int8 on the host, cached by tree shape (a chain, or the few tree
    shapes a drafter grows, repeat at every step). Read-only: callers copy it."""
    return ancestor_mask(parents).to(torch.int8)


class TreeVerifyBackend(TritonBackend):
    """Triton tree attention over metadata tensors set by :meth:`bind` (views of static buffers
    under a graph, so a replay reads whatever was copied in last). RoPE and the nodes' K/V write
    are one kernel, as in :class:`TritonBackend` (its ``rotate``)."""

    def bind(
        self,
        req_pool_indices: torch.Tensor,
        prefix_lens: torch.Tensor,
        node_slots: torch.Tensor,
        tree_mask: torch.Tensor,
    ) -> None:
        self.mode = ForwardMode.TARGET_VERIFY
        self.req_pool_indices, self.prefix_lens = req_pool_indices, prefix_lens
        self.node_slots, self.tree_mask = node_slots, tree_mask
        self.out_slots = node_slots  # where rotate() writes the nodes' K/V

    def init_metadata(self, forward_input: Any) -> None:
        raise NotImplementedError("TreeVerifyBackend is set up with bind(), not from a ForwardInput")

    def forward_verify(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        self._store(k, v, layer)  # unless rotate() wrote them already
        k_buf, v_buf = self.kv_pool.get_kv(layer)
        k_scale, v_scale = self.kv_pool.get_kv_scales(layer)
        if q.device.type == "cpu":  # the oracle: lets the padded layout be tested without a GPU
            return tree_verify_reference(
                q, k_buf, v_buf,
                req_to_token=self.req_to_token_pool.req_to_token, req_pool_indices=self.req_pool_indices,
                prefix_lens=self.prefix_lens, node_slots=self.node_slots, tree_mask=self.tree_mask.bool(),
                sm_scale=self.scale, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        return tree_verify_attention(
            q, k_buf, v_buf, q.new_empty(q.shape),
            req_to_token=self.req_to_token_pool.req_to_token, req_pool_indices=self.req_pool_indices,
            prefix_lens=self.prefix_lens, node_slots=self.node_slots, tree_mask=self.tree_mask,
            sm_scale=self.scale, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        raise RuntimeError("TreeVerifyBackend only runs verify passes")

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        raise RuntimeError("TreeVerifyBackend only runs verify passes")


class VerifyGraphRunner:
    """Padded verify passes for one model runner, replayed from CUDA graphs up to ``max_bs``.

    Parameters
    ----------
    runner:
        The target :class:`~phloem.runtime.executor.model_runner.ModelRunner` (CUDA).
    nodes:
        Nodes per request (the largest tree the drafter grows).
    max_bs:
        Largest batch captured; 0 captures nothing (every pass eager).
    """

    def __init__(self, runner: Any, *, nodes: int, max_bs: int) -> None:
        self.model = runner.model
        self.device = runner.device
        self.nodes = nodes
        self.attn = TreeVerifyBackend(
            runner.kv_pool, runner.req_to_token_pool, num_heads=runner.model_config.num_heads
        )
        self.batch_sizes = capture_batch_sizes(max_bs) if max_bs > 0 else []
        cap = max(self.batch_sizes, default=0)
        self.static = self._padded(cap, self.device)
        self._eye = torch.eye(nodes, dtype=torch.int8)  # a padding request's mask: every node sees itself
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool: Any = None
        self.capture_seconds = 0.0

    def _padded(self, bs: int, dev: torch.device) -> dict[str, torch.Tensor]:
        """Inputs of ``bs`` requests that are all padding (every node sees only itself)."""
        n = bs * self.nodes
        eye = torch.eye(self.nodes, dtype=torch.int8, device=dev)
        return {
            "input_ids": torch.zeros(n, dtype=torch.int64, device=dev),
            "positions": torch.zeros(n, dtype=torch.int64, device=dev),
            "node_slots": torch.full((n,), PADDING_SLOT, dtype=torch.int64, device=dev),
            "req_pool_indices": torch.zeros(bs, dtype=torch.int64, device=dev),
            "prefix_lens": torch.zeros(bs, dtype=torch.int64, device=dev),
            "tree_mask": eye.expand(bs, -1, -1).contiguous(),
        }

    def _views(self, bufs: dict[str, torch.Tensor], bs: int) -> dict[str, torch.Tensor]:
        n = bs * self.nodes
        return {
            k: (v[:bs] if k in ("req_pool_indices", "prefix_lens", "tree_mask") else v[:n])
            for k, v in bufs.items()
        }

    def _pass(self, v: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        self.attn.bind(v["req_pool_indices"], v["prefix_lens"], v["node_slots"], v["tree_mask"])
        hidden = self.model(v["input_ids"], v["positions"], self.attn)  # [bs * nodes, H]
        return self.model.compute_logits(hidden), hidden

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.batch_sizes:
            return
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()

        def run(bs: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self._pass(self._views(self.static, bs))

        self.graphs, self.outputs, self.pool = capture_graphs(self.batch_sizes, run, self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d verify graphs (batch 1..%d, %d nodes each) in %.2f s",
                    len(self.graphs), self.batch_sizes[-1], self.nodes, self.capture_seconds)  # fmt: skip

    def host_inputs(self, reqs: Sequence[Any], bs: int) -> dict[str, torch.Tensor]:
        """The padded inputs of ``reqs`` (``VerifyRequest``s) for a batch of ``bs >= len(reqs)``
        (built as Python lists: a handful of tensor ops per request would cost more than the pass
        takes to launch)."""
        n = self.nodes
        ids, pos, slots = [0] * (bs * n), [0] * (bs * n), [PADDING_SLOT] * (bs * n)
        rows, prefix = [0] * bs, [0] * bs
        mask = self._eye.expand(bs, -1, -1).clone()
        for b, r in enumerate(reqs):
            size = len(r.tree)
            if size > n:
                raise ValueError(f"a draft tree of {size} nodes exceeds the verify width {n}")
            lo = b * n
            ids[lo : lo + size] = r.tree.tokens
            pos[lo : lo + size] = [r.kv_len + d for d in r.tree.depths]
            slots[lo : lo + size] = r.slots.tolist()
            rows[b], prefix[b] = r.req_pool_idx, r.kv_len
            mask[b, :size, :size] = _ancestor_mask_i8(tuple(r.tree.parents))
        flat = torch.tensor(ids + pos + slots + rows + prefix, dtype=torch.int64)
        t = bs * n
        return {
            "input_ids": flat[:t], "positions": flat[t : 2 * t], "node_slots": flat[2 * t : 3 * t],
            "req_pool_indices": flat[3 * t : 3 * t + bs], "prefix_lens": flat[3 * t + bs :], "tree_mask": mask,
        }  # fmt: skip

    @torch.inference_mode()
    def run(
        self, reqs: Sequence[Any], *, device_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[bs * nodes, V]`` and hidden states ``[bs * nodes, H]`` (request ``b``'s node ``i``
        at row ``b * nodes + i``; ``bs >= len(reqs)``). Graph outputs are valid until the next run.
        ``device_ids``: ``(index, ids)``, node tokens already on the device (a previous step's
        samples), written at flat node positions ``index`` (host) over the trees' own tokens."""
        padded = next((s for s in self.batch_sizes if s >= len(reqs)), None)
        host = self.host_inputs(reqs, padded or len(reqs))
        dev = dict(zip(host, pack_to_device(list(host.values()), self.device)))
        if device_ids is not None:
            index, ids = device_ids
            dev["input_ids"][to_device(index, self.device)] = ids.to(self.device)
        if padded is None:  # beyond the graphs: the same pass, eagerly
            return self._pass(dev)
        for k, v in self._views(self.static, padded).items():
            v.copy_(dev[k])
        self.graphs[padded].replay()
        return self.outputs[padded]


class CpuChainAttention(CpuRowsAttention, TreeVerifyBackend):
    """The chain verify of a speculative window (``window.py``) as decode rows on the CPU
    (:class:`~phloem.runtime.attention.cpu.CpuRowsAttention`): node ``d`` of row ``r`` reads ``req_to_token[r, 0 :
    kv_len + d + 1]``, as plain decoding reads it at that position."""

    def bind(
        self,
        req_pool_indices: torch.Tensor,
        prefix_lens: torch.Tensor,
        node_slots: torch.Tensor,
        tree_mask: torch.Tensor,
    ) -> None:
        super().bind(req_pool_indices, prefix_lens, node_slots, tree_mask)
        bs, n = req_pool_indices.shape[0], tree_mask.shape[-1]
        reqs = req_pool_indices[:, None].expand(bs, n).reshape(-1)
        lens = (prefix_lens[:, None] + torch.arange(1, n + 1)).reshape(-1)
        self._tables = (node_slots, self.req_to_token_pool.req_to_token, reqs.contiguous(), lens)
