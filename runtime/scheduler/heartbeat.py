"""The scheduler process's heartbeat and watchdog (docs/design.md §8).

The loop stamps ``LoopWatch.passed`` each iteration and names what it is doing in
``Scheduler.doing`` (read through ``LoopWatch.activity``). A daemon thread (``HeartbeatThread``) sends the tokenizer manager a
``Heartbeat`` every ``HEARTBEAT_INTERVAL_S`` carrying the loop's age. The thread runs while a step
does (torch releases the GIL in its kernels), so beats mean "the process is alive" and the age says
whether the loop moves; a stopped or frozen process sends none, which the manager notices itself.

When one iteration has not ended for ``--watchdog-timeout`` seconds, the thread logs what the loop
is stuck in and ends the process with ``WATCHDOG_EXIT_CODE``: the server sees its child die and
exits non-zero instead of serving nothing forever.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from phloem.runtime.messages import Heartbeat

logger = logging.getLogger("phloem.scheduler")

HEARTBEAT_INTERVAL_S = 1.0
WATCHDOG_EXIT_CODE = 3


class LoopWatch:
    """When the loop last completed an iteration, and what it is doing now: written by the loop,
    read by the heartbeat thread (plain attribute stores, atomic under the GIL).

    ``activity`` returns a ``(verb, object)`` pair such as ``("process", "DECODE")``, which the
    loop keeps unformatted (``Scheduler.doing``): formatting happens only when a beat reads it."""

    def __init__(
        self,
        activity: Callable[[], tuple[str, str]] = lambda: ("", ""),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.activity = activity
        self.clock = clock
        self.passed = clock()

    def stamp(self) -> None:
        self.passed = self.clock()

    def age(self) -> float:
        return self.clock() - self.passed

    def describe(self) -> str:
        verb, what = self.activity()
        return f"{verb} {what}".strip() or "the loop"


class HeartbeatThread(threading.Thread):
    """Beats every ``interval`` seconds through ``send`` (called on this thread only, so it owns
    its socket); ends the process through ``exit`` once the loop is older than ``watchdog_timeout``."""

    def __init__(
        self,
        watch: LoopWatch,
        send: Callable[[Heartbeat], None],
        *,
        watchdog_timeout: float,
        interval: float = HEARTBEAT_INTERVAL_S,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        super().__init__(name="phloem-heartbeat", daemon=True)
        self.watch = watch
        self.send = send
        self.watchdog_timeout = watchdog_timeout
        self.interval = interval
        self.exit = exit
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.interval):
            self.beat()

    def beat(self) -> None:
        """One beat, or the watchdog's exit when the loop is stuck."""
        age = self.watch.age()
        doing = self.watch.describe()
        if age > self.watchdog_timeout:
            # The main thread is stuck in C or Python code that never returns; only this thread
            # can still say so, and only an immediate exit ends the process.
            logger.error(
                "watchdog: the scheduler loop has been stuck in '%s' for %.1f s (--watchdog-timeout %g); exiting",
                doing, age, self.watchdog_timeout,
            )  # fmt: skip
            for handler in logging.getLogger().handlers:
                handler.flush()
            self.exit(WATCHDOG_EXIT_CODE)
            return
        try:
            self.send(Heartbeat(loop_age=age, doing=doing))
        except Exception as e:  # a full queue or a closed socket: the next beat tries again
            logger.debug("heartbeat not sent: %s", e)

    def stop(self) -> None:
        self._stopped.set()
