"""Runs forward passes for the scheduler, in line or on a worker thread (the overlap loop).

The scheduler hands over a ``ForwardInput`` whose input ids may be *futures*: a negative id ``-k``
means "the token sampled into future slot ``k`` by an earlier step", which lets the scheduler
launch step N+1 before it has looked at step N's tokens. Steps run strictly in submission order,
so by the time step N+1 resolves its futures, step N has stored them.

On a GPU the same contract maps to a CUDA stream (the future buffer lives on the device and the
resolve is a ``torch.where``, or a copy of one slice of it when the step's rows wait on the previous
step's rows in order, the steady state of decoding); on the CPU the thread gives the overlap: the
scheduler does its bookkeeping while the thread runs the model. The CPU runs this loop only when
asked (``--enable-cpu-overlap-schedule``): both share the same cores, and on few of them the
thread slows the model more than it hides (``scheduler.builder.use_overlap``).

Continuous decode (``--num-continuous-decode-steps``): a decode ``ForwardInput`` with
``decode_steps = K`` runs as ``K`` forward passes in a row (``_run_steps``), each reading the tokens
the pass before it sampled, still on the device; only the last step's tokens go to the future map
(the next batch reads nothing earlier), and the output carries every step's tokens. When the
batch has a decode graph, the runner replays it ``K`` times instead (``forward_steps``), with no
Python between steps beyond their launches.

Host-tier KV loads (CUDA): the hierarchical cache stages them on the runner's ``kv_loader`` while
the scheduler admits requests; ``submit`` takes every load staged since the previous ``submit`` and
hands it to this step's forward pass, which lands it layer by layer. Taking them at submit, on the
scheduler thread, ties each load to the first step launched after it was staged, never to a step
launched before it (which may still read the slots the load reuses).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
from phloem.runtime.cache.host_pool import KVLoad
from phloem.runtime.executor.step_timer import StepTimer
from phloem.runtime.forward_io import ForwardInput, ForwardMode, ForwardOutput, decode_step_input
from phloem.runtime.host_copy import to_device


class FutureMap:
    """Ring buffer of sampled tokens, indexed by the positive future ids the scheduler hands out."""

    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        self.size = size
        self.buf = torch.zeros(size + 1, dtype=torch.int64, device=device)  # index 0 unused
        self._next = 1

    def reserve(self, n: int) -> range:
        """Future ids for the ``n`` rows of a step about to be launched (scheduler side): always a
        contiguous range, so storing into them is a slice copy (no index tensor to move)."""
        if self._next + n > self.size + 1:
            self._next = 1
        ids = range(self._next, self._next + n)
        self._next += n
        return ids

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        futures = _future_range(input_ids)
        if futures is not None:  # one slice of the ring: no index tensor to move, no select
            return self.buf[futures.start : futures.stop].clone()
        # [T]: negative ids are futures. No data-dependent branch: it would sync a GPU stream.
        ids = to_device(input_ids, self.buf.device)
        return torch.where(ids < 0, self.buf[(-ids).clamp(min=0)], ids)

    def store(self, future_ids: range, tokens: torch.Tensor) -> None:
        if not future_ids:
            return
        self.buf[future_ids.start : future_ids.stop].copy_(tokens, non_blocking=True)


def _future_range(input_ids: torch.Tensor) -> range | None:
    """``range(k, k + T)`` when the host ids are exactly ``-k, -(k + 1), ..., -(k + T - 1)``, else
    None. That is the overlap loop's steady state: a decode step whose rows all wait on the
    previous step's rows, in the same order. Read on the host only (never a device value)."""
    if not input_ids.is_cpu or input_ids.ndim != 1 or input_ids.numel() == 0:
        return None
    ids = input_ids.numpy()
    first = -int(ids[0])
    if first <= 0 or not np.array_equal(ids, np.arange(-first, -first - ids.size, -1)):
        return None
    return range(first, first + ids.size)


class InlineWorker:
    """Runs each step at once on the calling thread (``--disable-overlap-schedule``)."""

    def __init__(self, runner: Any, future_map: FutureMap) -> None:
        self.runner = runner
        self.future_map = future_map
        self.kv_loader = getattr(runner, "kv_loader", None)  # LayerwiseLoader on CUDA, else None
        # Tensor parallelism: rank 0 sends each step to the other ranks just before running it
        # (``tp_step.StepBroadcaster``); called on the thread that runs the step.
        self.before_step: Callable[[ForwardInput, range | None], None] | None = None
        self.timer = StepTimer(getattr(runner, "device", None))  # decode steps' device time

    def submit(self, fi: ForwardInput, future_ids: range | None) -> Future[ForwardOutput]:
        fut: Future[ForwardOutput] = Future()
        try:
            fut.set_result(self._run(fi, future_ids, self._take_loads()))
        except BaseException as e:  # surfaced to the scheduler through the future
            fut.set_exception(e)
        return fut

    def _take_loads(self) -> list[KVLoad]:
        return self.kv_loader.take() if self.kv_loader is not None else []

    def run_step(self, fi: ForwardInput, future_ids: range | None) -> ForwardOutput:
        """Run one step now, on this thread (a tensor-parallel follower's loop)."""
        return self._run(fi, future_ids, ())

    def _run(self, fi: ForwardInput, future_ids: range | None, loads: Sequence[KVLoad]) -> ForwardOutput:
        if self.before_step is not None:
            self.before_step(fi, future_ids)
        fi.input_ids = self.future_map.resolve(fi.input_ids)
        if fi.then is not None:
            out = self._run_lead(fi)
        elif fi.chain_width:
            mark = self.timer.start()
            out = self.runner.forward_chain(fi)
            out.step_time = self.timer.stop(mark, fi.decode_steps)
        elif fi.mode is ForwardMode.DECODE:
            out = self._run_decode(fi, loads)
        else:
            out = self.runner.forward(fi, kv_loads=loads) if loads else self.runner.forward(fi)
        if future_ids is not None:
            self.future_map.store(future_ids, out.next_token_ids)
        return out

    def _run_lead(self, fi: ForwardInput) -> ForwardOutput:
        """A jump-forward lead pass, then the decode steps behind it (``fi.then``) from its
        sampled tokens, which stay on the device; the output carries every step's tokens."""
        tail = fi.then
        assert tail is not None
        lead = self.runner.forward(dataclasses.replace(fi, then=None))
        rest = self._run_decode(dataclasses.replace(tail, input_ids=lead.next_token_ids), ())
        return ForwardOutput(
            next_token_ids=rest.next_token_ids,
            next_token_ids_cpu=rest.next_token_ids_cpu,
            copy_done=rest.copy_done,
            steps=[lead, *(rest.steps or [rest])],
            step_time=rest.step_time,  # the decode steps only: the lead pass is an extend
        )

    def _run_decode(self, fi: ForwardInput, loads: Sequence[KVLoad]) -> ForwardOutput:
        """Decode steps (one, or a continuous decode batch), their device time measured."""
        mark = self.timer.start()
        if fi.decode_steps > 1:
            out = self._run_steps(fi, loads)
        else:
            out = self.runner.forward(fi, kv_loads=loads) if loads else self.runner.forward(fi)
        out.step_time = self.timer.stop(mark, fi.decode_steps)
        return out

    def _run_steps(self, fi: ForwardInput, loads: Sequence[KVLoad]) -> ForwardOutput:
        """A continuous decode batch: its steps back to back, each step's sampled tokens (still on
        the device) the next step's input; the host reads none of them in between. Sampling
        tensors move to the device once for all steps."""
        by_graph = getattr(self.runner, "forward_steps", None)
        if by_graph is not None and not loads:
            out = by_graph(fi)  # graph replays back to back, or None: no graph for this batch
            if out is not None:
                return out
        device = getattr(self.runner, "device", None)
        if device is not None and torch.device(device).type != "cpu":
            fi = fi.with_sampling_on(device)
        ids = fi.input_ids
        steps: list[ForwardOutput] = []
        for j in range(fi.decode_steps):
            step = decode_step_input(fi, j, ids)
            out = self.runner.forward(step, kv_loads=loads) if loads and j == 0 else self.runner.forward(step)
            ids = out.next_token_ids
            steps.append(out)
        last = steps[-1]
        return ForwardOutput(
            next_token_ids=last.next_token_ids,
            next_token_ids_cpu=last.next_token_ids_cpu,
            copy_done=last.copy_done,
            steps=steps,
        )

    def close(self) -> None:
        pass


class OverlapWorker(InlineWorker):
    """Runs steps on a dedicated thread, in submission order."""

    def __init__(self, runner: Any, future_map: FutureMap) -> None:
        super().__init__(runner, future_map)
        self._q: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="phloem-forward", daemon=True)
        self._thread.start()

    def submit(self, fi: ForwardInput, future_ids: range | None) -> Future[ForwardOutput]:
        fut: Future[ForwardOutput] = Future()
        self._q.put((fi, future_ids, self._take_loads(), fut))
        return fut

    def _loop(self) -> None:
        # A thread starts on CUDA device 0 whatever the process set: on a replica's other GPU,
        # stream-less calls here (an event's record, the current stream) would go to device 0.
        if self.timer.cuda:
            torch.cuda.set_device(self.timer.device)  # the runner's
        while True:
            item = self._q.get()
            if item is None:
                return
            fi, future_ids, loads, fut = item
            try:
                fut.set_result(self._run(fi, future_ids, loads))
            except BaseException as e:
                fut.set_exception(e)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)
