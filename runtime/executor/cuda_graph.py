"""CUDA-graph capture and replay of decode steps (docs/design.md §5).

One graph per captured batch size (1, 2, 4, 8, then every 16 up to ``max_bs``), all sharing one
memory pool. A decode batch of ``B`` rows replays the smallest captured size ``>= B``: its inputs
are copied into static buffers, the spare rows padded to write the padding slot and read one key,
and the graph's logits ``[:B]`` are returned. What a graph covers::

    attention metadata -> embedding -> every layer (KV writes included) -> final norm -> logits

With early exit (``decode_exit.py``) that whole forward sits in an IF node on a device flag, so a
continuous decode step after every row's stop skips it. Sampling stays outside (its shape
depends on the batch's sampling options). The attention backend
must do device work only in ``init_metadata`` for decode (``supports_cuda_graph = True``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from phloem.runtime.cache.kv_pool import PADDING_SLOT
from phloem.runtime.forward_io import ForwardInput, ForwardMode

if TYPE_CHECKING:
    from phloem.runtime.attention.base import AttentionBackend
    from phloem.runtime.executor.decode_exit import DecodeExit

__all__ = ["CudaGraphRunner", "capture_batch_sizes", "capture_graphs", "stage_step_rows"]

logger = logging.getLogger(__name__)


class DecodeModel(Protocol):
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def capture_batch_sizes(max_bs: int) -> list[int]:
    """``[1, 2, 4, 8, 16, 32, 48, ...]`` up to and including ``max_bs``."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs]
    sizes += list(range(16, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def capture_graphs(
    batch_sizes: Sequence[int], run: Callable[[int], Any], device: torch.device, *, pool: Any = None
) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, Any], Any]:
    """Capture ``run(bs)`` for every size, largest first, on a side stream, all graphs in one memory
    pool (the smaller ones reuse the largest one's memory; ``pool``: an existing pool to share).
    ``run`` must read its inputs from static buffers. Returns the graphs, what each capture
    returned (its static outputs) and the pool."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, Any] = {}
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for bs in sorted(batch_sizes, reverse=True):
            for _ in range(2):  # compile kernels and create library handles outside the capture
                run(bs)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs[bs] = run(bs)
            if pool is None:
                pool = graph.pool()
            graphs[bs] = graph
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    return graphs, outputs, pool


class CudaGraphRunner:
    """Decode graphs for one model and attention backend.

    Parameters
    ----------
    model:
        Called as ``model(input_ids, positions, attn_backend) -> hidden [T, H]`` with a
        ``compute_logits(hidden) -> [T, V]`` method.
    attn_backend:
        Must set ``supports_cuda_graph = True``.
    max_bs:
        Largest batch replayed; larger decode batches run eagerly.
    """

    def __init__(
        self, model: DecodeModel, attn_backend: AttentionBackend, *, max_bs: int, exit: DecodeExit | None = None
    ) -> None:
        if not getattr(attn_backend, "supports_cuda_graph", False):
            raise ValueError(f"{type(attn_backend).__name__} cannot be captured in a CUDA graph")
        self.model, self.attn = model, attn_backend
        # Early exit (decode_exit.py): each graph's forward sits in an IF node on ``exit.go``.
        self.exit = exit
        self.device = attn_backend.kv_pool.device
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        n = self.max_bs

        def buf(fill: int) -> torch.Tensor:
            return torch.full((n,), fill, dtype=torch.int64, device=self.device)

        # Padding rows: token 0 at position 0, writes the padding slot, reads one key (seq_len 1).
        # The four per-row inputs a host batch fills are rows of one block (one staged copy).
        self.input_ids = buf(0)
        self._rows = torch.from_numpy(np.repeat(_PADDING_ROW, n, axis=1)).to(self.device)
        self.positions, self.out_slots, self.req_pool_indices, self.seq_lens = self._rows.unbind()
        self._staging = _PinnedRing(tuple(self._rows.shape))
        self._steps: dict[int, tuple[_PinnedRing, torch.Tensor]] = {}  # see _step_buffers
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool: Any = None  # the graphs' shared memory pool handle, set by the first capture
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def can_run(self, fi: ForwardInput) -> bool:
        return fi.mode == ForwardMode.DECODE and fi.batch_size <= self.max_bs and bool(self.graphs)

    def _static_input(self, bs: int, sampling_like: ForwardInput | None = None) -> ForwardInput:
        from phloem.runtime.executor.model_runner import greedy_sampling_info

        return ForwardInput(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_slots=self.out_slots[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            prefix_lens=self.seq_lens[:bs] - 1,
            extend_lens=torch.ones(bs, dtype=torch.int64, device=self.device),
            sampling=greedy_sampling_info(bs),
        )

    def _run_model(self, fi: ForwardInput) -> torch.Tensor:
        self.attn.init_metadata(fi)
        hidden = self.model(fi.input_ids, fi.positions, self.attn)  # [bs, H]
        return self.model.compute_logits(hidden)  # [bs, V]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the smaller graphs reuse its pool); logs time and memory."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # so the reserved-memory difference is what the graphs keep
        reserved_before = torch.cuda.memory_reserved(self.device)
        start = time.perf_counter()

        inputs = {bs: self._static_input(bs) for bs in self.batch_sizes}  # built outside the captures

        def run(bs: int) -> torch.Tensor:
            if self.exit is None or not torch.cuda.is_current_stream_capturing():
                return self._run_model(inputs[bs])
            with self.exit.gated():
                return self._run_model(inputs[bs])

        if self.exit is not None:
            self.exit.open()
            self.exit.warm_up(self.batch_sizes)  # its kernel compiled before the first launch

        self.graphs, self.logits, self.pool = capture_graphs(self.batch_sizes, run, self.device)
        self.capture_seconds = time.perf_counter() - start
        torch.cuda.empty_cache()  # the graphs' private pool stays; warm-up leftovers go
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        logger.info(
            "captured %d decode graphs (batch 1..%d) in %.2f s, %.1f MiB",
            len(self.graphs), self.max_bs, self.capture_seconds, self.capture_bytes / 2**20,
        )  # fmt: skip

    def replay(self, fi: ForwardInput) -> torch.Tensor:
        """Logits ``[B, V]`` of decode batch ``fi`` (on the device); valid until the next replay.

        ``fi``'s per-row tensors may be on the device, or on the host (``input_ids`` excepted):
        then they reach the graph's inputs in one copy of a pinned staging block."""
        bs = fi.batch_size
        padded = next(s for s in self.batch_sizes if s >= bs)
        if self.exit is not None:
            self.exit.open()
        if fi.positions.device.type == "cpu":
            self.input_ids[:bs].copy_(fi.input_ids, non_blocking=True)
            self._stage_rows(fi, bs, padded)
            self.graphs[padded].replay()
            return self.logits[padded][:bs]
        self.input_ids[:bs].copy_(fi.input_ids, non_blocking=True)
        self.positions[:bs].copy_(fi.positions, non_blocking=True)
        self.out_slots[:bs].copy_(fi.out_slots, non_blocking=True)
        self.req_pool_indices[:bs].copy_(fi.req_pool_indices, non_blocking=True)
        self.seq_lens[:bs].copy_(fi.seq_lens, non_blocking=True)
        if padded > bs:
            self.out_slots[bs:padded].fill_(PADDING_SLOT)
            self.req_pool_indices[bs:padded].fill_(0)
            self.seq_lens[bs:padded].fill_(1)
        self.graphs[padded].replay()
        return self.logits[padded][:bs]

    def replay_steps(
        self,
        fi: ForwardInput,
        sample: Callable[[torch.Tensor], torch.Tensor],
        stops: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Tokens ``[K, B]`` (on the device) of continuous decode batch ``fi`` (``decode_steps = K``,
        per-row tensors on the host): ``K`` replays of one graph back to back, each step's
        ``sample(logits [B, V]) -> [B]`` copied into the next replay's input ids on the device.

        Every step's positions, slots, rows and lengths reach the device in one staged copy, and
        a step then costs the host four launches (its rows into the graph's inputs, the replay,
        the sampler, the ids). A whole forward pass per step costs the worker more CPU time than
        a small model's step takes on the GPU, so the host would set the pace there.

        With early exit (``self.exit`` and the batch's ``stop_tags``/``stop_ids`` on the device,
        in ``stops``), one more launch a step marks the rows that sampled a stop, and the replays
        after every row's stop skip their forward; their sampled ids are garbage nobody reads."""
        steps, bs = fi.decode_steps, fi.batch_size
        padded = next(s for s in self.batch_sizes if s >= bs)
        ring, rows = self._step_buffers(steps)
        k, block = ring.take()
        stage_step_rows(block, fi, padded)
        rows.copy_(ring.bufs[k], non_blocking=True)
        ring.record(k)
        self.input_ids[:bs].copy_(fi.input_ids, non_blocking=True)
        graph, logits = self.graphs[padded], self.logits[padded][:bs]
        gate = self.exit if stops is not None else None
        if self.exit is not None and gate is None:
            self.exit.open()
        tokens: list[torch.Tensor] = []
        for j in range(steps):
            self._rows.copy_(rows[j], non_blocking=True)
            if gate is not None and j == 0:  # a launch queued before the host saw the stop
                gate.update(self.req_pool_indices[:bs], *stops)  # type: ignore[misc]
            graph.replay()
            ids = sample(logits)
            if gate is not None:
                gate.update(self.req_pool_indices[:bs], *stops, ids, step_follows=j + 1 < steps)  # type: ignore[misc]
            if j + 1 < steps:
                self.input_ids[:bs].copy_(ids, non_blocking=True)
            tokens.append(ids)
        if gate is not None:
            gate.publish()
        return torch.stack(tokens)

    def _step_buffers(self, steps: int) -> tuple[_PinnedRing, torch.Tensor]:
        """The pinned ring and the device block ``[steps, 4, max_bs]`` of ``steps``-step batches
        (made on first use: one pair per step count the scheduler asks for, a few KiB each)."""
        pair = self._steps.get(steps)
        if pair is None:
            shape = (steps, *self._rows.shape)
            pair = self._steps[steps] = (
                _PinnedRing(shape),
                torch.empty(shape, dtype=torch.int64, device=self.device),
            )
        return pair

    def _stage_rows(self, fi: ForwardInput, bs: int, padded: int) -> None:
        """Positions, output slots, request rows and lengths of host batch ``fi`` (padding rows
        after them) into the next pinned block, then one copy of the block to the graph inputs."""
        k, block = self._staging.take()
        block[0, :bs] = fi.positions.numpy()
        block[1, :bs] = fi.out_slots.numpy()
        block[2, :bs] = fi.req_pool_indices.numpy()
        block[3, :bs] = fi.seq_lens.numpy()
        if padded > bs:
            block[:, bs:padded] = _PADDING_ROW
        self._rows.copy_(self._staging.bufs[k], non_blocking=True)
        self._staging.record(k)


# Padding row of the staged block: position 0, the padding slot, request row 0, one key.
_PADDING_ROW = np.array([[0], [PADDING_SLOT], [0], [1]], dtype=np.int64)


def stage_step_rows(block: np.ndarray, fi: ForwardInput, padded: int) -> None:
    """The graph inputs of every step of continuous decode batch ``fi`` (host tensors) into
    ``block`` ``[K, 4, >= padded]``: step ``j`` reads position and length ``+ j`` and writes
    ``step_slots[j]``, as :func:`~phloem.runtime.forward_io.decode_step_input` gives it;
    columns ``bs:padded`` are padding rows."""
    assert fi.step_slots is not None
    steps, bs = fi.decode_steps, fi.batch_size
    j = np.arange(steps, dtype=np.int64)[:, None]
    block[:, 0, :bs] = fi.positions.numpy()[None, :] + j
    block[:, 1, :bs] = fi.step_slots.numpy()
    block[:, 2, :bs] = fi.req_pool_indices.numpy()[None, :]
    block[:, 3, :bs] = fi.seq_lens.numpy()[None, :] + j
    if padded > bs:
        block[:, :, bs:padded] = _PADDING_ROW[None]


class _PinnedRing:
    """Pinned host blocks handed out in turn. A block is refilled only after the copy that last
    read it has run (its event; in the overlap loop that copy is two steps old and long done),
    so the host never writes memory a queued copy is about to read."""

    def __init__(self, shape: tuple[int, ...], n: int = 4) -> None:
        self.bufs = [torch.zeros(shape, dtype=torch.int64, pin_memory=True) for _ in range(n)]
        self.arrays = [b.numpy() for b in self.bufs]
        self.events = [torch.cuda.Event() for _ in range(n)]
        self._i = 0

    def take(self) -> tuple[int, np.ndarray]:
        self._i = (self._i + 1) % len(self.bufs)
        self.events[self._i].synchronize()  # returns at once unless that copy is still queued
        return self._i, self.arrays[self._i]

    def record(self, k: int) -> None:
        self.events[k].record()
