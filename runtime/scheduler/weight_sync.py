"""The scheduler's side of weight broadcasts: the groups it joined and a thread that talks to them.

Joining a group and receiving a broadcast wait on the trainer, possibly for minutes. They run on
one daemon thread, in arrival order, so the scheduler loop keeps serving requests (and beating)
meanwhile; the loop collects finished jobs each iteration (:meth:`WeightSync.finished`). Only the
loop thread touches ``groups`` and the model: the thread receives into new buffers, and the copy
into the weights is queued like any other weight update.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from phloem.runtime.errors import InvalidRequest
from phloem.runtime.executor import weight_group as wg
from phloem.runtime.messages import (
    DestroyWeightsGroupReq,
    InitWeightsGroupReq,
    UpdateWeightsFromDistributedReq,
)

logger = logging.getLogger("phloem.scheduler")

GroupMsg: TypeAlias = InitWeightsGroupReq | UpdateWeightsFromDistributedReq | DestroyWeightsGroupReq


@dataclass
class Finished:
    """A job done on the group thread: its message, and its result or the error it raised."""

    msg: GroupMsg
    result: Any = None
    error: BaseException | None = None


class GroupWorker:
    """One daemon thread running jobs in the order submitted (a receive must not overtake the
    join before it). Daemon: a broadcast the trainer never sends must not keep the process alive."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[GroupMsg, Callable[[], Any]]] = queue.Queue()
        self._done: queue.Queue[Finished] = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, msg: GroupMsg, job: Callable[[], Any]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="weight-group", daemon=True)
            self._thread.start()
        self._jobs.put((msg, job))

    def finished(self) -> list[Finished]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def _run(self) -> None:
        while True:
            msg, job = self._jobs.get()
            try:
                self._done.put(Finished(msg, result=job()))
            except BaseException as e:  # reported to the loop, which answers the client
                self._done.put(Finished(msg, error=e))


class WeightSync:
    """Groups joined by this scheduler, by name, and the jobs in flight on the group thread."""

    def __init__(self, device: Any) -> None:
        self.device = device  # the model's
        self.groups: dict[str, wg.WeightGroup] = {}
        self.pending: dict[int, GroupMsg] = {}  # by req_id, until finished
        self._joining: set[str] = set()
        self._worker = GroupWorker()

    def start_join(self, msg: InitWeightsGroupReq) -> None:
        """Check the request, then join on the group thread. Raises ``InvalidRequest``."""
        wg.check_group_request(
            msg.master_address, msg.master_port, msg.rank_offset, msg.world_size, msg.group_name, msg.backend,
            self.device,
        )
        if msg.group_name in self.groups or msg.group_name in self._joining:
            raise InvalidRequest("group_name", f"{msg.group_name!r} is already joined; destroy it first")
        device = self.device if msg.backend == "nccl" else "cpu"

        def join() -> wg.WeightGroup:
            return wg.join_group(
                msg.master_address, msg.master_port, msg.rank_offset, msg.world_size, msg.group_name, msg.backend,
                device=device,
            )

        self._joining.add(msg.group_name)
        self._submit(msg, join)

    def start_receive(self, msg: UpdateWeightsFromDistributedReq, model: Any) -> None:
        """Check names, dtypes and shapes against ``model`` and the group, then receive on the
        group thread. Raises ``InvalidRequest`` (nothing is received then)."""
        group = self._group(msg.group_name)
        specs = wg.check_broadcast_update(model, msg.names, msg.dtypes, msg.shapes)
        self._submit(msg, lambda: group.receive(specs))

    def start_destroy(self, msg: DestroyWeightsGroupReq) -> None:
        """Forget the group now (no new update may use it) and close it after the jobs before."""
        group = self._group(msg.group_name)
        del self.groups[msg.group_name]
        self._submit(msg, group.close)

    def finished(self) -> list[Finished]:
        """Jobs done since the last call; a joined group is registered here, on the loop thread."""
        done = self._worker.finished()
        for f in done:
            self.pending.pop(f.msg.req_id, None)
            if isinstance(f.msg, InitWeightsGroupReq):
                self._joining.discard(f.msg.group_name)
                if f.error is None:
                    self.groups[f.msg.group_name] = f.result
                    logger.info("joined weight group %s as rank %d", f.msg.group_name, f.msg.rank_offset)
        return done

    def _group(self, name: str) -> wg.WeightGroup:
        group = self.groups.get(name)
        if group is None:
            raise InvalidRequest("group_name", f"no weight update group {name!r}; joined: {sorted(self.groups)}")
        return group

    def _submit(self, msg: GroupMsg, job: Callable[[], Any]) -> None:
        self.pending[msg.req_id] = msg
        self._worker.submit(msg, job)
