"""The tensor-parallel group of this process, and the collectives the model layers call.

Every scheduler process of a ``--tp-size N`` engine holds one :class:`TPGroup`. Model layers read
it at construction (to size their shard) through :func:`get_tp` and call its collectives in
``forward``; with ``N == 1`` (the default, and every process that never called :func:`init_tp`)
the group is a single rank and every collective returns its input untouched, so a one-device
engine runs exactly the code it ran before tensor parallelism existed.

Two torch.distributed groups over the same ranks:

- ``device_group``: the model's tensors (NCCL on CUDA, gloo on the CPU).
- ``cpu_group``: gloo, for Python objects rank 0 sends the other ranks (each step's batch, control
  messages). Its timeout is long: a follower rank waits in it for as long as the engine is idle.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TPGroup", "destroy_tp", "get_tp", "init_tp", "shard_range"]

# A follower waits for rank 0's next step inside the object broadcast; an idle engine must not
# time it out. (The device group keeps torch's default: a collective inside a step that waits
# this long is a hung peer.)
_IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class TPGroup:
    """Rank ``rank`` of ``size`` tensor-parallel ranks; ``size == 1`` has no groups."""

    rank: int = 0
    size: int = 1
    device_group: Any = None
    cpu_group: Any = None

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one that schedules, samples for the API and talks to the other processes."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks (in place; returns ``x``)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` concatenated along ``dim``, in rank order (same shape on every rank)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank (in place; returns ``x``)."""
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.device_group)
        return x

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank ``src``'s picklable ``obj`` on every rank (the others pass anything, e.g. None)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]


_TP = TPGroup()


def get_tp() -> TPGroup:
    """This process's tensor-parallel group (a single rank unless :func:`init_tp` ran)."""
    return _TP


def init_tp(*, rank: int, size: int, init_method: str, device: torch.device) -> TPGroup:
    """Join the ``size``-rank group as ``rank`` and make it this process's (see :func:`get_tp`).

    ``init_method``: a torch.distributed rendezvous URL, e.g. ``tcp://10.0.0.1:29500`` (every rank
    of every node passes the same one). ``device``: where this rank computes; CUDA ranks use NCCL
    for tensors, CPU ranks gloo.
    """
    global _TP
    if size == 1:
        _TP = TPGroup()
        return _TP
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, init_method=init_method, rank=rank, world_size=size,
            timeout=_IDLE_TIMEOUT if backend == "gloo" else None,
        )  # fmt: skip
    ranks = list(range(size))
    device_group = dist.group.WORLD if backend == "gloo" else dist.new_group(ranks, backend="nccl")
    cpu_group = dist.new_group(ranks, backend="gloo", timeout=_IDLE_TIMEOUT)
    _TP = TPGroup(rank=rank, size=size, device_group=device_group, cpu_group=cpu_group)
    return _TP


def destroy_tp() -> None:
    """Leave the group (tests that start several groups in one process, and shutdown)."""
    global _TP
    if _TP.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _TP = TPGroup()


def shard_range(total: int, rank: int, size: int, *, what: str) -> tuple[int, int]:
    """``[lo, hi)`` of rank ``rank``'s equal share of ``total`` items.

    Raises
    ------
    ValueError
        When ``size`` does not divide ``total``; the message names ``what`` (e.g. "attention
        heads") so the user sees which dimension constrains ``--tp-size``.
    """
    if total % size:
        raise ValueError(f"--tp-size {size} does not divide the model's {total} {what}")
    share = total // size
    return rank * share, (rank + 1) * share
