"""The scheduler process checks the KV pool invariant (O(pool size)) only after a whole idle poll
interval with no message, never in the gap between a finished request and the next one."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from phloem.runtime.cache.allocator import TokenSlotAllocator
from phloem.runtime.cache.cache_manager import CacheIntegrityError, CacheManager
from phloem.runtime.cache.radix_tree import RadixTree
from phloem.runtime.scheduler.heartbeat import LoopWatch
from phloem.runtime.scheduler.process import SchedulerProcess


def run_loop(script: list[tuple[bool, bool, bool]]) -> list[int]:
    """Drive ``SchedulerProcess.loop`` through ``script`` = per iteration (idle before it, a
    message arrives, step busy); returns the iterations after which the check ran."""
    proc = object.__new__(SchedulerProcess)
    proc.running, proc._idle_checked, proc._last_stats = True, True, time.monotonic() + 1e9
    proc._weight_updates, proc._flush_pending = [], False
    it = iter(script)
    now: dict[str, object] = {}
    checks: list[int] = []

    def receive(*, block: bool) -> bool:
        assert block == now["idle"]
        return bool(now["arrived"])

    def step() -> bool:
        busy = bool(now["busy"])
        now["i"] = int(now["i"]) + 1  # type: ignore[call-overload]
        advance()
        return busy

    def advance() -> None:
        nxt = next(it, None)
        if nxt is None:
            proc.running = False
            now.update(idle=True, arrived=False, busy=False)
        else:
            now.update(idle=nxt[0], arrived=nxt[1], busy=nxt[2])

    class Sched:
        stopped = False  # never paused here

        @property
        def is_idle(self) -> bool:
            return bool(now["idle"])

        def step(self) -> bool:
            return step()

    proc.scheduler = Sched()  # type: ignore[assignment]
    proc.watch = LoopWatch(lambda: None)  # stamped each iteration for the heartbeat
    proc.receive = receive  # type: ignore[method-assign]
    proc.rt = SimpleNamespace(cache=SimpleNamespace(check_integrity=lambda: checks.append(int(now["i"]))))  # type: ignore[call-overload]
    now["i"] = 0
    advance()
    proc.loop(parent_pid=0)
    return checks


def test_integrity_check_waits_for_an_idle_poll_interval():
    script = [
        (False, True, True), (False, False, True),  # a request arrives and runs
        (True, True, True),  # it finished; the next request arrives within the poll: no check
        (False, False, False),  # a step with nothing to do, not idle yet (in-flight bookkeeping)
        (True, False, False),  # idle for a whole poll interval: check now
        (True, False, False), (True, False, False),  # still idle: not again
        (True, True, True), (True, False, False),  # work came and went: check again when idle
    ]  # fmt: skip
    assert run_loop(script) == [5, 9]


def test_duplicate_slot_is_found_without_sorting_the_pool():
    table = torch.zeros(2, 16, dtype=torch.int64)
    cm = CacheManager(allocator=TokenSlotAllocator(33), req_to_token=table, tree=RadixTree())
    cm.check_integrity()
    slots = cm.alloc(4)
    assert slots is not None
    cm.check_integrity(private=slots)
    try:
        cm.check_integrity(private=torch.cat([slots[:3], slots[:1]]))  # 3 + 1 duplicate, count right
    except CacheIntegrityError as e:
        assert "held twice" in str(e)
    else:
        raise AssertionError("a duplicated slot went unnoticed")
