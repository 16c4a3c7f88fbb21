"""The launcher's watchdog and child clean-up: a scheduler silent for ``--watchdog-timeout`` breaks
the engine, and ``EngineProcesses.terminate`` ends a stopped (SIGSTOP) child, which never acts on
SIGTERM."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time

from phloem.runtime import launch
from phloem.runtime.ipc import IpcPaths
from phloem.runtime.launch import EngineProcesses


class _Tm:
    """The two things the watchdog reads, scripted."""

    def __init__(self, lost: str = "") -> None:
        self.lost = lost
        self.status = "serving"
        self.reason = ""

    def health(self) -> str:
        return self.status

    def heartbeat_lost(self) -> str:
        return self.lost

    def mark_broken(self, reason: str) -> None:
        self.status, self.reason = "broken", reason


class _Procs:
    def __init__(self, alive: bool = True) -> None:
        self.alive = alive

    def all_alive(self) -> bool:
        return self.alive

    def dead(self) -> list[str]:
        return ["phloem-scheduler (exit code 3)"]


def _run_watchdog(tm: _Tm, procs: _Procs, monkeypatch) -> None:
    monkeypatch.setattr(launch, "WATCHDOG_INTERVAL_S", 0.01)
    asyncio.run(asyncio.wait_for(launch._watchdog(tm, procs), 5))  # type: ignore[arg-type]


def test_a_silent_scheduler_breaks_the_engine(monkeypatch):
    tm = _Tm(lost="no scheduler heartbeat for 8.1 s (--watchdog-timeout 8)")
    _run_watchdog(tm, _Procs(), monkeypatch)
    assert tm.status == "broken"
    assert tm.reason == "the scheduler is hung: no scheduler heartbeat for 8.1 s (--watchdog-timeout 8)"


def test_a_dead_child_breaks_the_engine(monkeypatch):
    tm = _Tm()
    _run_watchdog(tm, _Procs(alive=False), monkeypatch)
    assert tm.reason == "child process died: phloem-scheduler (exit code 3)"


def _sleep_forever() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        time.sleep(1)


def test_terminate_kills_a_stopped_child():
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_sleep_forever, name="stopped-child", daemon=True)
    child.start()
    try:
        os.kill(child.pid, signal.SIGSTOP)
        start = time.monotonic()
        EngineProcesses(ipc=IpcPaths.fresh(), procs=[child]).terminate(timeout=0.1)
        assert not child.is_alive()
        assert child.exitcode == -signal.SIGKILL  # SIGTERM stayed pending while it was stopped
        assert time.monotonic() - start < 2 * launch.TERM_GRACE_S + 1
    finally:
        if child.is_alive():
            child.kill()
