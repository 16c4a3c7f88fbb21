"""Early exit of continuous decode: graph replays skip their forward once every row has stopped.

A continuous decode launch runs ``K`` decode steps before the host sees any token, and with the
overlap loop the host has already queued the next launch by then. A batch whose rows all sample
a stop token at step ``j`` would run the rest of that launch and the whole next one for nothing,
which at batch 1 is a noticeable share of a short answer such as a JSON record.

Here the decode graph's forward sits inside a CUDA graph conditional node (an IF node on the
device flag ``go``), and after each step's sampler one small kernel marks the rows that sampled
a stop token and recomputes ``go``::

    done[rows[b]] = tags[b]               where tokens[b] is one of stop_ids[b, :]
    go            = any(done[rows[b]] != tags[b] for b < B)

``done`` has one entry per request-pool row and survives launches, so the next launch, queued
before the host saw the stop, starts with ``go`` false too. ``tags[b]`` is the request's stop tag
(``Req.stop_tag``), renewed whenever device tokens of the request are thrown away, so a flag
left by an earlier request in the row, or by a launch whose tokens became stale, never matches.

Why skipping is safe: the scheduler lists a row's stop ids only when sampling one of them
certainly ends the request on the host (``policy.device_stop_ids``), and tokens after a row's
end are dropped there. A row without stop ids is never done, so its batch never skips. What a
skipped step leaves (the previous step's logits, sampled again) is read by nobody.

The oracle is :func:`stop_flags_reference`; the Triton kernel is one program over the batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["DecodeExit", "conditional_graphs_supported", "stop_flags_reference"]


def conditional_graphs_supported() -> bool:
    """Whether this torch can capture a region of a CUDA graph into an IF node (CUDA 12.4+)."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        return False
    version = torch.version.cuda or "0.0"
    major, minor = (int(x) for x in version.split(".")[:2])
    return (major, minor) >= (12, 4)


def stop_flags_reference(
    done: torch.Tensor,
    rows: torch.Tensor,
    tags: torch.Tensor,
    stop_ids: torch.Tensor,
    tokens: torch.Tensor | None,
) -> torch.Tensor:
    """Plain torch: mark the rows whose token is one of their stop ids in ``done`` (in place) and
    return ``go`` (a bool scalar): whether some row of the batch has not stopped."""
    if tokens is not None:
        hit = ((tokens[:, None] == stop_ids) & (stop_ids >= 0)).any(dim=1)
        done[rows[hit]] = tags[hit]
    return (done[rows] != tags).any()


class DecodeExit:
    """The device state of early exit for one decode graph runner: ``go`` (what the graphs'
    conditional nodes read) and ``done`` (a stop tag per request-pool row), and the counter of
    steps that skipped their forward (``skipped``, read with a sync: for benchmarks and tests)."""

    def __init__(self, pool_rows: int, device: torch.device) -> None:
        self.device = device
        self.go = torch.ones((), dtype=torch.bool, device=device)
        self._may_be_closed = False  # whether an update ran since the last open (host side)
        self.done = torch.zeros(pool_rows, dtype=torch.int64, device=device)  # tags start at 1
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        # its host mirror, refreshed without a wait after each gated launch (``publish``)
        self._skipped_host = torch.zeros((), dtype=torch.int64, pin_memory=device.type == "cuda")

    @contextmanager
    def gated(self) -> Iterator[None]:
        """Capture what runs inside into an IF node of the graph being captured: replays run it
        only while ``go`` is true."""
        graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
        graph.begin_capture_to_if_node(self.go)
        try:
            yield
        finally:
            graph.end_capture_to_conditional_node()

    def open(self) -> None:
        """Every gated step runs (batches that carry no stop ids, one-step replays). A launch
        only where an ``update`` may have cleared the flag since the last ``open``: one-step
        replays call this every step."""
        if self._may_be_closed:
            self.go.fill_(True)
            self._may_be_closed = False

    def update(
        self,
        rows: torch.Tensor,
        tags: torch.Tensor,
        stop_ids: torch.Tensor,
        tokens: torch.Tensor | None = None,
        *,
        step_follows: bool = True,
    ) -> None:
        """Mark the rows whose ``tokens`` (``[B]``, None at a launch's start) hit a stop, then set
        ``go`` for the next step, which counts as skipped when it is false (``step_follows``:
        False after a launch's last step, whose flags only matter to the next launch). All on the
        device: ``rows`` and ``tags`` ``[B]`` int64, ``stop_ids`` ``[B, K]`` int64 (-1 pads)."""
        if rows.shape[0] == 0:
            raise ValueError("an empty batch has no decode step to gate")
        self._may_be_closed = True
        if self.device.type != "cuda":
            go = stop_flags_reference(self.done, rows, tags, stop_ids, tokens)
            self.go.copy_(go)
            if step_follows:
                self._skipped += (~go).to(torch.int64)
            return
        from phloem.runtime.executor.decode_exit_triton import stop_flags

        stop_flags(self.done, rows, tags, stop_ids, tokens, self.go, self._skipped, count=step_follows)

    def warm_up(self, batch_sizes: list[int]) -> None:
        """Compile the kernel for every batch width a decode graph replays (a compile in the
        middle of serving stalls a step), then start clean."""
        for bs in batch_sizes:
            rows = torch.zeros(bs, dtype=torch.int64, device=self.device)
            stops = torch.full((bs, 1), -1, dtype=torch.int64, device=self.device)
            self.update(rows, rows + 1, stops)
            self.update(rows, rows + 1, stops, rows)
        self.done.zero_()
        self._skipped.zero_()
        self._skipped_host.zero_()
        self.open()

    @property
    def skipped(self) -> int:
        """Steps skipped so far (waits for the device)."""
        return int(self._skipped.item())

    def publish(self) -> None:
        """Queue a copy of the skipped count to the host mirror (no wait)."""
        self._skipped_host.copy_(self._skipped, non_blocking=True)

    @property
    def skipped_published(self) -> int:
        """Steps skipped as of a recent launch, read without waiting (live stats)."""
        return int(self._skipped_host)
