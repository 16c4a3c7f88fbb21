"""The tokenizer manager's view of the scheduler's heartbeat (docs/design.md §8).

The scheduler process beats about once a second from a thread of its own, also while a step runs
(``runtime/scheduler/heartbeat.py``); each beat carries the age of the scheduler loop's last
completed iteration. From the newest beat ``Liveness`` tells three states apart:

- **alive**: beats arrive and the loop moves;
- **stalled** (``/health`` answers 503, new requests are refused): no beat for ``silence_s``, or
  the loop has not passed for ``loop_s``. Beats resuming clear it;
- **lost**: no beat for ``watchdog_s`` (``--watchdog-timeout``). A stopped or frozen process
  cannot report itself, so the server gives up on it (``launch._watchdog``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

# Beats come every second from a thread that runs during steps too, so five missing ones mean the
# process is stopped, frozen, or holds the GIL for seconds: never merely busy.
SILENCE_STALL_S = 5.0
# A step that takes this long is not a normal one even on a slow CPU (a prefill chunk takes about a
# second there); an update of the weights from disk may legitimately take this long, and requests
# could not be served meanwhile anyway. Generous, so long steps never flip /health.
LOOP_STALL_S = 60.0


class Liveness:
    """Heartbeat bookkeeping with an injectable clock (``time.monotonic`` by default)."""

    def __init__(
        self,
        *,
        watchdog_s: float,
        silence_s: float = SILENCE_STALL_S,
        loop_s: float = LOOP_STALL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # A short watchdog (tests, impatient deployments) lowers the stall thresholds with it, so
        # /health reports a stall no later than the watchdog acts on it.
        self.watchdog_s = watchdog_s
        self.silence_s = min(silence_s, watchdog_s)
        self.loop_s = min(loop_s, watchdog_s)
        self.clock = clock
        self.last_beat = clock()
        self.loop_age = 0.0  # as of the last beat
        self.doing = ""

    def beat(self, loop_age: float = 0.0, doing: str = "") -> None:
        self.last_beat = self.clock()
        self.loop_age = loop_age
        self.doing = doing

    def silence(self) -> float:
        """Seconds since the newest beat."""
        return self.clock() - self.last_beat

    def stall(self) -> str:
        """Why the scheduler counts as stalled, or "" when it does not."""
        silence = self.silence()
        if silence > self.silence_s:
            return f"no scheduler heartbeat for {silence:.1f} s"
        loop_age = self.loop_age + silence
        if loop_age > self.loop_s:
            where = f" (in '{self.doing}')" if self.doing else ""
            return f"the scheduler loop has not completed an iteration for {loop_age:.1f} s{where}"
        return ""

    def lost(self) -> str:
        """Why the scheduler is given up on (no beat for the watchdog timeout), or ""."""
        silence = self.silence()
        if silence > self.watchdog_s:
            return f"no scheduler heartbeat for {silence:.1f} s (--watchdog-timeout {self.watchdog_s:g})"
        return ""
