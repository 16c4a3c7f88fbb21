"""The EAGLE draft and catch-up as CUDA graphs (docs/design.md §5, §7).

Eager, one tree level of :meth:`EagleDraftWorker.draft_many` is ~40 small kernels launched from
Python, so a draft of four levels costs milliseconds of host time for microseconds of GPU work.
Both batched passes are fixed sequences of kernels once three things are fixed:

- the batch, padded to a captured size (as decode graphs pad theirs): spare rows read and write
  a scratch row of the draft cache that no sequence owns;
- the committed key width ``W`` every row reads, rounded up to a power of two (at least 64): each
  row masks the keys past its own length, so a wider ``W`` changes no result;
- the draft cache's storage (the graphs read and write it in place).

So graphs are keyed by ``(pass, padded batch, W)`` and captured on first use. The catch-up's
attention reads each query's key count on the device where the kernel of :mod:`.draft_attention`
runs (CUDA, 16-bit): there its key drops ``W``. Inputs travel in
one pinned copy into static buffers::

    draft     [3, bs] int64: cache row, committed length, root position
              -> [bs, 2, num_draft_tokens - 1] kept tokens and parents (one device->host read)
    catch-up  flat int64: ids, positions, draft positions [bs, M]; rows, last query [bs]
              + features [bs, M, H]   -> writes K/V and the root features into the cache

with ``M = num_steps + 1``, the most tokens one verify commits. All graphs share one memory pool:
each graph's output is read before any other graph runs. When the cache outgrows its storage,
every graph is dropped and recaptured as needed; the cache starts with a row for every sequence a
graph can hold, so only the length grows, a few times over a server's life.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from phloem.runtime.executor.cuda_graph import capture_batch_sizes, capture_graphs
from phloem.runtime.host_copy import pack_to_device
from phloem.runtime.speculative.draft_attention import uses_kernel

if TYPE_CHECKING:
    from phloem.runtime.speculative.eagle import EagleDraftWorker

__all__ = ["RESERVED_DRAFT_LENGTH", "SCRATCH_SEQ", "EagleGraphs"]

logger = logging.getLogger(__name__)

SCRATCH_SEQ = -1  # the draft cache's key of the scratch row (no scheduler row is negative)
_MIN_WIDTH = 64
# Draft-cache positions to reserve up front when serving: a growth of the cache moves its storage
# and drops every captured graph (EAGLE passes and speculative windows), each to be captured again
# on its next use, mid-run; reserving keeps the usual widths on one storage.
RESERVED_DRAFT_LENGTH = 1024


class _Pass:
    """One captured (or, off CUDA, eagerly run) padded pass: static inputs and its output."""

    def __init__(self, inputs: list[torch.Tensor], fn: Callable[[], Any]) -> None:
        self.inputs, self.fn = inputs, fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: Any = None

    def run(self) -> Any:
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.output


class EagleGraphs:
    """Padded, fixed-shape draft and catch-up passes of one :class:`EagleDraftWorker`.

    Parameters
    ----------
    worker:
        The draft worker (its ``graphs`` attribute points here).
    max_bs:
        Largest batch handled; larger ones fall back to the worker's eager passes.
    capture:
        Capture CUDA graphs (on CUDA only); otherwise run the same padded passes eagerly.
    reserve:
        Draft-cache positions to hold from the start (serving: :data:`RESERVED_DRAFT_LENGTH`).
    """

    def __init__(
        self, worker: EagleDraftWorker, *, max_bs: int, capture: bool = True, reserve: int = 0
    ) -> None:
        self.worker = worker
        self.batch_sizes = capture_batch_sizes(max(1, max_bs))
        self.m = worker.num_steps + 1
        self.capture = capture and worker.device.type == "cuda"
        worker.cache.ensure(rows=self.batch_sizes[-1] + 1, length=max(_MIN_WIDTH, reserve))
        (self.pad_row,) = worker.cache.reserve([SCRATCH_SEQ], [self.m])
        self.passes: dict[tuple[str, int, int], _Pass] = {}
        self.pool: Any = None
        self._storage = self._storage_key()
        self.captured = 0  # graphs captured so far (recaptures included)
        self.capture_seconds = 0.0

    # ---- entry points (None / False: not handled, the caller runs its eager pass) ------------
    @torch.inference_mode()
    def draft(self, seqs: list[int]) -> torch.Tensor | None:
        """:meth:`EagleDraftWorker.draft_many` through a padded pass: the kept tokens and parents
        ``[len(seqs), 2, n]`` on the device (valid until another graph of this object runs)."""
        bs = self._padded(len(seqs))
        if bs is None:
            return None
        w = self.worker
        host = w.draft_inputs(seqs, bs, pad_row=self.pad_row)
        width = self._width(int(host[1, : len(seqs)].max()))
        dev = cast(torch.Tensor, pack_to_device([host], w.device)[0])

        def make() -> _Pass:
            static = torch.empty_like(dev)

            def fn() -> torch.Tensor:
                rows, lens, root_pos = static.unbind(0)
                return w._select_core(*w._grow_core(rows, lens, root_pos, width))

            return _Pass([static], fn)

        p = self._pass(("draft", bs, width), make, [dev])
        return p.run()[: len(seqs)]

    @torch.inference_mode()
    def extend(
        self, seqs: list[int], tokens_per_seq: list[list[int]], features_per_seq: list[torch.Tensor]
    ) -> bool:
        """:meth:`EagleDraftWorker.extend_many` through a padded pass."""
        bs = self._padded(len(seqs))
        if bs is None or max(len(t) for t in tokens_per_seq) > self.m:
            return False
        w = self.worker
        flat, entry, need = w.extend_inputs(seqs, tokens_per_seq, bs, self.m, pad_row=self.pad_row)
        width = self._width(need)
        dev_flat, dev_entry = cast(list[torch.Tensor], pack_to_device([flat, entry], w.device))
        feats = torch.cat(features_per_seq)

        def make() -> _Pass:
            static_flat = torch.empty_like(dev_flat)
            static_feats = feats.new_zeros((bs, self.m, feats.shape[-1]))
            views = w.extend_views(static_flat, bs, self.m)
            return _Pass([static_flat, static_feats], lambda: w._extend_core(*views, static_feats, width))

        # the attention kernel reads each query's key count on the device: one pass for every width
        key = ("extend", bs, 0 if uses_kernel(feats) else width)
        p = self._pass(key, make, [dev_flat])
        # real queries' features; padding queries keep stale, finite ones (their output is unused)
        p.inputs[1].view(bs * self.m, -1).index_copy_(0, dev_entry, feats)
        if p.graph is None and self.capture:
            self._capture(p, key)
        p.run()
        return True

    # ---- internals ----------------------------------------------------------------------------
    def _padded(self, n: int) -> int | None:
        return next((s for s in self.batch_sizes if s >= n), None)

    def _width(self, need: int) -> int:
        """Key width for ``need`` committed entries; the cache is grown to hold it."""
        width = max(_MIN_WIDTH, 1 << max(need - 1, 0).bit_length())
        self.worker.cache.ensure(rows=0, length=width)
        return width

    def _storage_key(self) -> tuple[int, int, int]:
        c = self.worker.cache
        return c.k.data_ptr(), c.v.data_ptr(), c.features.data_ptr()

    def _pass(
        self, key: tuple[str, int, int], make: Callable[[], _Pass], inputs: list[torch.Tensor]
    ) -> _Pass:
        """The pass for ``key`` (created on first use) with ``inputs`` copied into its static
        buffers. A draft pass is captured here; a catch-up pass after its features are in."""
        if self._storage_key() != self._storage:  # the cache grew: graphs point at freed storage
            if self.capture:
                torch.cuda.synchronize(self.worker.device)  # no replay in flight when they are destroyed
            self.passes.clear()
            self.pool = None
            self._storage = self._storage_key()
        p = self.passes.get(key)
        if p is None:
            p = self.passes[key] = make()
        for static, src in zip(p.inputs, inputs):
            static.copy_(src)
        if p.graph is None and self.capture and key[0] == "draft":
            self._capture(p, key)
        return p

    def _capture(self, p: _Pass, key: tuple[str, int, int]) -> None:
        # warm-up runs and the capture read the inputs already in place; both passes are
        # idempotent for fixed inputs (catch-up rewrites the same K/V and features)
        start = time.perf_counter()
        graphs, outputs, self.pool = capture_graphs(
            [key[1]], lambda _: p.fn(), self.worker.device, pool=self.pool
        )
        p.graph, p.output = graphs[key[1]], outputs[key[1]]
        self.captured += 1
        self.capture_seconds += time.perf_counter() - start
        logger.info("captured the EAGLE %s graph for batch %d, key width %d in %.3f s",
                    key[0], key[1], key[2], time.perf_counter() - start)  # fmt: skip
