"""Continuous decode that takes a grammar's forced tokens as it goes (``PHLOEM_JUMP_CHAIN``).

Under a grammar on the device (docs/design.md §6) a row often sits in a state whose mask allows
one token only: a JSON key, its quotes and colon, spelled the tokenizer's way. Plain decoding
spends a whole step of the batch on each such token; host jump-forward takes them in one extend,
but only after the host has seen the row's state, which ends the launch. Here every step of a
continuous launch is a padded chain pass of ``W`` nodes a row (the verify pass's layout,
``verify_graph.py``)::

    row b:  node 0 = its last token x | nodes 1..L = the tokens forced after x | padding
    L = how many forced tokens follow (at most W - 1): the state after x forces f1, the
        state after f1 forces f2, ... (``TableSnapshot.chain``: the only token a state allows)

The step samples from node ``L``'s logits under the state after ``f_L`` and the row moves on
``L + 1`` positions. A row in a free or branching state has ``L = 0``: a decode row. So the
forced run costs no step of its own and no host round trip, and a row's tokens are exactly
what decoding them one a step would give (the mask of a forced state allows that token alone).

The walk, the layout and the row's state and position advance on the device
(:func:`chain_layout`; ``chain_triton.py`` in one launch on CUDA), the model pass replays a
graph per batch size, and the host reads every step's tokens once, at the end: ``[K, B, W]``
tokens (node ``i < L`` the forced ones, node ``L`` the sampled one, -1 after) and ``[K, B]``
counts (``L + 1``).

Where a row's tokens go is known only on the device, so positions and slots are taken there
too. The scheduler gives each row a block of ``K * W`` slots (``ForwardInput.chain_slots``), as
many as a launch may reach; the pass writes the ``j``-th position the row reaches this launch
into ``req_to_token`` with block slot ``j``, and the scheduler frees the rest of the block once
it reads the counts. A row's position lives on the device (``row_pos``, by request-pool row),
so the next launch may start before the host has read this one's tokens: it passes -1 for the
rows whose position it does not know (a chain launch of theirs is in flight).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from phloem.runtime.cache.kv_pool import PADDING_SLOT
from phloem.runtime.executor.cuda_graph import capture_batch_sizes, capture_graphs
from phloem.runtime.executor.verify_graph import TreeVerifyBackend
from phloem.runtime.forward_io import ForwardInput
from phloem.runtime.host_copy import to_host_async

__all__ = ["ChainDecoder", "chain_layout"]

logger = logging.getLogger(__name__)


def chain_layout(
    *,
    state: torch.Tensor,
    rows: torch.Tensor,
    chain: torch.Tensor,
    keys: torch.Tensor,
    targets: torch.Tensor,
    vocab: int,
    req_to_token: torch.Tensor,
    cur: torch.Tensor,
    pos: torch.Tensor,
    start: torch.Tensor,
    block: torch.Tensor,
    out: dict[str, torch.Tensor],
    emitted: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """One step's chain pass for ``B`` rows, in torch (the reference of ``chain_triton``).

    Reads each row's automaton state ``state[rows[b]]`` (int32), last token ``cur [B]`` and
    position ``pos [B]`` (where ``cur``'s K/V goes); walks the forced tokens (``chain [S]``
    int32, -1 where a state forces nothing; ``keys``/``targets`` the table's transitions) up to
    ``W - 1`` of them; gives node ``i`` the slot ``block[b, pos - start + i]`` (``start [B]``: the
    row's position when the launch began, ``block [B, K * W]``) and writes it into
    ``req_to_token`` at the node's position; writes the pass's inputs into ``out`` (``ids``,
    ``positions``, ``node_slots`` ``[B * W]``, ``rows``, ``prefix``, ``last`` ``[B]``,
    ``tree_mask [B, W, W]`` int8), the forced tokens into ``emitted [B, W]`` (-1 after them) and
    ``L + 1`` into ``counts [B]``; leaves ``state[rows]`` at the state after the forced tokens
    and advances ``pos`` by ``L + 1``."""
    b = rows.shape[0]
    w = emitted.shape[1]
    dev = cur.device
    s = state[rows].to(torch.int64)
    forced = torch.full((b, w - 1), -1, dtype=torch.int64, device=dev)
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    for i in range(w - 1):
        f = chain[s].to(torch.int64)
        alive &= f >= 0
        key = s * vocab + f.clamp(min=0)
        at = torch.searchsorted(keys, key)  # in range: the table ends with a sentinel key
        nxt = torch.where(keys[at] == key, targets[at].to(torch.int64), torch.zeros_like(s))
        s = torch.where(alive, nxt, s)
        forced[:, i] = torch.where(alive, f, -1)
    n = (forced >= 0).sum(dim=1)  # L: forced tokens are a prefix of the walk
    state[rows] = s.to(state.dtype)
    node = torch.arange(w, device=dev)
    real = node[None, :] <= n[:, None]  # [B, W]
    ids = torch.cat([cur.to(torch.int64)[:, None], forced.clamp(min=0)], dim=1)
    where = pos[:, None] + node[None, :]
    taken = (where - start[:, None]).clamp(max=block.shape[1] - 1)  # block index of each node
    slots = torch.where(real, block.gather(1, taken), PADDING_SLOT)
    req_to_token[rows[:, None].expand_as(where)[real], where[real]] = slots[real]
    out["ids"].copy_(torch.where(real, ids, 0).reshape(-1))
    out["positions"].copy_(where.reshape(-1))
    out["node_slots"].copy_(slots.reshape(-1))
    out["rows"].copy_(rows)
    out["prefix"].copy_(pos)
    sees = (node[None, None, :] <= node[None, :, None]) & real[:, :, None]  # node i sees 0..i
    out["tree_mask"].copy_((sees | torch.eye(w, dtype=torch.bool, device=dev)).to(torch.int8))
    out["last"].copy_(torch.arange(b, device=dev) * w + n)
    emitted.copy_(torch.cat([forced, torch.full((b, 1), -1, dtype=torch.int64, device=dev)], dim=1))
    counts.copy_(n + 1)
    pos += n + 1


class ChainDecoder:
    """Chain passes of ``width`` nodes a row for one model runner (CUDA graphs up to ``max_bs``
    rows; eager on the CPU and above ``max_bs``).

    Parameters
    ----------
    runner:
        The :class:`~phloem.runtime.executor.model_runner.ModelRunner` (one rank).
    width:
        Nodes a row each step: its last token and up to ``width - 1`` forced ones.
    max_bs:
        Largest batch captured (0: none).
    """

    def __init__(self, runner: Any, *, width: int, max_bs: int) -> None:
        if width < 2:
            raise ValueError(f"a chain pass needs at least 2 nodes a row, got {width}")
        self.model = runner.model
        self.device = runner.device
        self.width = width
        self.req_to_token = runner.req_to_token_pool.req_to_token
        # each request-pool row's next position, where its last chain launch left it
        self.row_pos = torch.zeros(self.req_to_token.shape[0], dtype=torch.int64, device=self.device)
        self.attn = TreeVerifyBackend(
            runner.kv_pool, runner.req_to_token_pool, num_heads=runner.model_config.num_heads
        )
        self.batch_sizes = capture_batch_sizes(max_bs) if max_bs > 0 and self.device.type == "cuda" else []
        self.static = self._buffers(max(self.batch_sizes, default=0))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None
        self.launches = 0  # chain launches run (a benchmark reads it)

    def _buffers(self, bs: int) -> dict[str, torch.Tensor]:
        """Inputs of ``bs`` rows that are all padding (every node writes the padding slot and
        sees only itself)."""
        n, w, dev = bs * self.width, self.width, self.device
        return {
            "ids": torch.zeros(n, dtype=torch.int64, device=dev),
            "positions": torch.zeros(n, dtype=torch.int64, device=dev),
            "node_slots": torch.full((n,), PADDING_SLOT, dtype=torch.int64, device=dev),
            "rows": torch.zeros(bs, dtype=torch.int64, device=dev),
            "prefix": torch.zeros(bs, dtype=torch.int64, device=dev),
            "tree_mask": torch.eye(w, dtype=torch.int8, device=dev).expand(bs, w, w).contiguous(),
            "last": torch.arange(bs, dtype=torch.int64, device=dev) * w,
        }

    def _views(self, bufs: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
        """Rows ``lo:hi`` of every buffer."""
        w = self.width
        flat = ("ids", "positions", "node_slots")
        return {k: (v[lo * w : hi * w] if k in flat else v[lo:hi]) for k, v in bufs.items()}

    def _pass(self, v: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits ``[bs, V]`` of each row's last real node."""
        self.attn.bind(v["rows"], v["prefix"], v["node_slots"], v["tree_mask"])
        hidden = self.model(v["ids"], v["positions"], self.attn)  # [bs * W, H]
        return self.model.compute_logits(hidden[v["last"]])

    def drop(self) -> None:
        """Forget the graphs (their memory pool too): launches run eagerly until recaptured."""
        self.graphs, self.outputs, self.pool = {}, {}, None

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.batch_sizes:
            return
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        self.graphs, self.outputs, self.pool = capture_graphs(
            self.batch_sizes, lambda bs: self._pass(self._views(self.static, 0, bs)), self.device
        )
        logger.info(
            "captured %d chain decode graphs (batch 1..%d, %d nodes a row) in %.2f s",
            len(self.graphs), self.batch_sizes[-1], self.width, time.perf_counter() - start,
        )  # fmt: skip

    @torch.inference_mode()
    def run(self, fi: ForwardInput, sample: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Any, ...]:
        """The ``fi.decode_steps`` chain steps of decode batch ``fi`` (host tensors but its ids,
        which may be on the device; ``positions`` -1 where the row continues from ``row_pos``;
        ``chain_slots [B, K * W]`` each row's block; ``sampling`` on the device with its
        automaton's starting states applied).
        Returns ``(the last step's sampled ids [B] on the device and on the host, tokens
        [K, B, W] and counts [K, B] on the host, the event after which the host ones are
        valid)``."""
        steps, bs, w = fi.decode_steps, fi.batch_size, self.width
        auto = fi.sampling.automaton
        assert auto is not None, "a chain launch walks the grammars on the device"
        snap = auto.snapshot
        dev = self.device
        # the ids may be on the device already (resolved futures); the rest are host tensors
        assert fi.chain_slots is not None and fi.chain_slots.shape == (bs, steps * w)
        cur = fi.input_ids.to(dev, torch.int64).clone()
        host = torch.cat([fi.positions, fi.req_pool_indices, fi.chain_slots.reshape(-1)]).to(torch.int64)
        moved = host.to(dev, non_blocking=True)
        given, rows, block = moved[:bs], moved[bs : 2 * bs], moved[2 * bs :].view(bs, steps * w)
        pos = torch.where(given >= 0, given, self.row_pos[rows])
        start = pos.clone()
        emitted = torch.empty((steps, bs, w), dtype=torch.int64, device=dev)
        counts = torch.empty((steps, bs), dtype=torch.int64, device=dev)
        padded = next((s for s in self.batch_sizes if s >= bs and s in self.graphs), None)
        if padded is not None:
            if padded > bs:  # the graph's spare rows: padding
                pad = self._buffers(padded - bs)
                for k, v in self._views(self.static, bs, padded).items():
                    v.copy_(pad[k] + (bs * w if k == "last" else 0))
            bufs = self._views(self.static, 0, bs)
        else:
            bufs = self._buffers(bs)
        layout = _layout_fn(dev)
        for j in range(steps):
            layout(
                state=auto.table.state, rows=rows, chain=snap.chain, keys=snap.keys, targets=snap.targets,
                vocab=snap.vocab_size, req_to_token=self.req_to_token, cur=cur, pos=pos, start=start,
                block=block, out=bufs, emitted=emitted[j], counts=counts[j],
            )  # fmt: skip
            if padded is not None:
                self.graphs[padded].replay()
                logits = self.outputs[padded][:bs]
            else:
                logits = self._pass(bufs)
            ids = sample(logits)
            emitted[j].scatter_(1, (counts[j] - 1)[:, None], ids[:, None])
            cur.copy_(ids)
        self.row_pos[rows] = pos
        self.launches += 1
        flat = torch.cat([cur, counts.reshape(-1), emitted.reshape(-1)])
        cpu, event = to_host_async(flat)
        n = steps * bs
        return cur, cpu[:bs], cpu[bs + n :].view(steps, bs, w), cpu[bs : bs + n].view(steps, bs), event


def _layout_fn(device: torch.device) -> Callable[..., None]:
    """The Triton layout on CUDA with the fused kernels on, the torch reference elsewhere."""
    if device.type == "cuda":
        from phloem.runtime.layers.fusion import fused_kernels_enabled

        if fused_kernels_enabled():
            from phloem.runtime.executor.chain_triton import chain_layout_triton

            return chain_layout_triton
    return chain_layout
