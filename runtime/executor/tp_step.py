"""Tensor-parallel steps: rank 0 schedules, every other rank replays its steps (docs/design.md §9).

Only rank 0 runs a ``Scheduler``. Before each step runs on rank 0, :class:`StepBroadcaster` sends
it to the other ranks ("followers"), which run it through the same worker code on their shard of
the model (:func:`follow`). The invariant: **every rank runs the same sequence of steps, in the
same order, on the same slot layout**, so every collective inside the model meets its partners.
It holds by construction, with no agreement protocol: there is one decision maker. (One scheduler
per rank kept in lockstep would need every choice the scheduler makes to be deterministic; ours
look at clocks and at which asynchronous job finished first: the overlap loop, grammar compiles,
the continuous-decode time budget.)

What a follower needs for one step, and how it travels:

- the :class:`~phloem.runtime.forward_io.ForwardInput`, over the gloo group as a Python object.
  Its sampling parameters are replaced by greedy ones (a follower's own draw is overwritten, see
  below), so grammar masks and device-side penalty tables never travel. Fields that live on rank
  0's device (``out_slots`` gathered from the slot table, for example) travel as tensors over the
  device group instead, so rank 0 never waits for its stream to read them.
- the rows of the ``req_to_token`` slot table this step reads (``[B, width]``, over the device
  group). The scheduler writes that table on rank 0 only (prefix matches, new slots, the tree's
  slots replacing duplicates); the follower copies the rows in before running. Gathered when the
  step runs, the rows hold exactly what rank 0's own forward pass of the step reads.
- the sampled tokens: each rank samples from the same all-gathered logits, then
  :meth:`ModelRunner.forward` broadcasts rank 0's tokens over the device group, so a row sampled
  under a grammar or a seed that only rank 0 knows is the same token everywhere, and each rank's
  future map (the overlap loop's next inputs) holds the same ids.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from phloem.runtime.distributed.state import TPGroup
from phloem.runtime.forward_io import ForwardInput

__all__ = ["Hello", "OnDevice", "StepBroadcaster", "StepMessage", "follow", "follower_view"]

logger = logging.getLogger("phloem.tp")

_TOP_TENSORS = ("input_ids", "positions", "out_slots", "req_pool_indices", "seq_lens", "prefix_lens",
                "extend_lens", "step_slots")  # fmt: skip


@dataclass(frozen=True)
class OnDevice:
    """Stands in for a tensor of rank 0's device in a pickled step: it follows over the device
    group, in field order."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Hello:
    """First message after start-up: sizes the followers must match."""

    future_map_size: int


@dataclass
class StepMessage:
    fi: ForwardInput  # follower view: greedy sampling, device tensors as OnDevice
    future_ids: range | None
    table_width: int  # columns of the slot-table rows that follow the step


def follower_view(fi: ForwardInput) -> tuple[ForwardInput, list[torch.Tensor]]:
    """``fi`` as followers get it, and the device tensors it left out (in field order)."""
    from phloem.runtime.executor.model_runner import greedy_sampling_info

    moved: list[torch.Tensor] = []
    changes: dict[str, Any] = {"sampling": greedy_sampling_info(len(fi.seq_lens))}
    for name in _TOP_TENSORS:
        t = getattr(fi, name)
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            moved.append(t)
            changes[name] = OnDevice(tuple(t.shape), t.dtype)
    lp = fi.logprobs
    if lp is not None and lp.return_logprob.device.type != "cpu":
        changes["logprobs"] = dataclasses.replace(lp, return_logprob=lp.return_logprob.cpu())
    return dataclasses.replace(fi, **changes), moved


def table_width(fi: ForwardInput) -> int:
    """Columns of each row's slot-table entries this step reads: its longest sequence, plus the
    later steps of a continuous decode batch (their slots are written before the launch)."""
    lens = fi.seq_lens
    longest = int(lens.max()) if lens.numel() and lens.device.type == "cpu" else -1
    if longest < 0:  # lengths on the device: the whole row (rare: host lengths are the rule)
        return -1
    return longest + max(fi.decode_steps - 1, 0)


class StepBroadcaster:
    """Rank 0's side: sends each step to the followers just before rank 0 runs it (on the thread
    that runs it, so the order of sends is the order of execution)."""

    def __init__(self, tp: TPGroup, req_to_token: torch.Tensor) -> None:
        self.tp = tp
        self.table = req_to_token  # [rows, context] int64 on rank 0's device

    def hello(self, future_map_size: int) -> None:
        self.tp.broadcast_object(Hello(future_map_size=future_map_size))

    def __call__(self, fi: ForwardInput, future_ids: range | None) -> None:
        view, moved = follower_view(fi)
        width = table_width(fi)
        if width < 0:
            width = self.table.shape[1]
        width = min(width, self.table.shape[1])
        self.tp.broadcast_object(StepMessage(fi=view, future_ids=future_ids, table_width=width))
        for t in moved:
            self.tp.broadcast(t.contiguous())
        rows = fi.req_pool_indices.to(self.table.device, non_blocking=True)
        self.tp.broadcast(self.table[rows, :width].contiguous())

    def stop(self) -> None:
        """Tell the followers the engine is shutting down (after the last step)."""
        self.tp.broadcast_object(None)


def receive_step(tp: TPGroup, msg: StepMessage, req_to_token: torch.Tensor) -> ForwardInput:
    """A follower's side of :meth:`StepBroadcaster.__call__`: the step with its device tensors
    received, and its slot-table rows copied into ``req_to_token``."""
    device = req_to_token.device
    fi = msg.fi
    changes = {}
    for name in _TOP_TENSORS:
        spec = getattr(fi, name)
        if isinstance(spec, OnDevice):
            changes[name] = tp.broadcast(torch.empty(spec.shape, dtype=spec.dtype, device=device))
    if changes:
        fi = dataclasses.replace(fi, **changes)
    rows = fi.req_pool_indices.to(device)
    block = tp.broadcast(torch.empty((len(rows), msg.table_width), dtype=req_to_token.dtype, device=device))
    req_to_token[rows, : msg.table_width] = block
    return fi


def follow(tp: TPGroup, runner: Any) -> None:
    """A follower rank's loop: run each step rank 0 sends, until it sends the stop."""
    from phloem.runtime.executor.worker import FutureMap, InlineWorker

    hello = tp.broadcast_object(None)
    if hello is None:
        return
    assert isinstance(hello, Hello), f"expected the start-up message, got {type(hello).__name__}"
    worker = InlineWorker(runner, FutureMap(hello.future_map_size, device=runner.device))
    table = runner.req_to_token_pool.req_to_token
    steps = 0
    while True:
        msg = tp.broadcast_object(None)
        if msg is None:
            logger.info("rank %d: stop after %d steps", tp.rank, steps)
            return
        fi = receive_step(tp, msg, table)
        worker.run_step(fi, msg.future_ids)
        steps += 1
