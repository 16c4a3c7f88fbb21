"""The scheduler's counters, step timings and log lines."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phloem.runtime.scheduler.batch import ScheduledBatch

if TYPE_CHECKING:
    from phloem.runtime.scheduler.scheduler import Scheduler

logger = logging.getLogger("phloem.scheduler")


@dataclass(frozen=True)
class StepTimes:
    """Host seconds of one ``Scheduler.step``: choosing the batch, launching it (building its
    inputs and handing them to the worker), and processing the oldest step in flight (waiting
    for its tokens included)."""

    kind: str  # the launched batch's mode ("" when nothing was launched)
    rows: int
    schedule: float
    launch: float
    process: float


@dataclass
class SchedulerCounters:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    num_retracted: int = 0
    gen_throughput: float = 0.0
    jump_forward_tokens: int = 0
    # tokens computed in a launch that was in flight when its request jumped, then thrown away
    jump_stale_tokens: int = 0
    jump_lead_launches: int = 0  # continuous decode launches led by a jump's extend (steps.lead)
    chain_launches: int = 0  # chain decode launches (steps.chain)
    chain_forced_tokens: int = 0  # forced tokens those took without sampling (kept ones)
    near_end_syncs: int = 0  # decode batches processed at once: every row might have ended
    continuous_decode_steps: int = 0  # decode steps run inside continuous decode batches
    prefill_batches: int = 0  # prefill (extend) passes whose results were processed
    spec_window_steps: int = 0  # speculative steps run inside windows (several per host sync)


class StepLog:
    """One log line per prefill pass, one per ``log_interval`` decode launches, with the
    generation throughput since the last decode line."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.decode_launches = 0  # decode batches scheduled (a continuous or window batch counts once)
        self._tokens = 0  # decode tokens kept since the last decode line
        self._last = time.monotonic()

    def decode_processed(self, tokens: int, steps: int = 1) -> None:
        self._tokens += tokens
        if self.decode_launches % self.s.cfg.log_interval == 0:
            self._decode_line(steps)

    def prefill(self, batch: ScheduledBatch) -> None:
        s = self.s
        new_tokens = sum(batch.extend_lens)
        # tokens this pass did not compute: each prompt row's prefix when it was launched
        cached = sum(p for p, row in zip(batch.prefix_lens, batch.prefill_row) if row)
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            len(batch.reqs),
            new_tokens,
            cached,
            s.live_stats()["token_usage"],
            len(s.running),
            len(s.waiting),
        )

    def _decode_line(self, steps: int) -> None:
        s = self.s
        now = time.monotonic()
        dt = max(now - self._last, 1e-6)
        s.stats.gen_throughput = self._tokens / dt
        self._last, self._tokens = now, 0
        extra = f", accept len: {s.spec.mean_accept_length:.2f}" if s.spec is not None else ""
        if steps > 1:  # a continuous decode launch: one line for its steps
            extra += f", #steps: {steps}"
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
            "gen throughput (token/s): %.2f, #queue-req: %d%s",
            len(s.running),
            s.cache.total_size - s.cache.available_size,
            s.live_stats()["token_usage"],
            s.stats.gen_throughput,
            len(s.waiting),
            extra,
        )
