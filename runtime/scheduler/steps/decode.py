"""Plain decode: one token for every running request that still needs one."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from phloem.runtime.forward_io import ForwardMode, ForwardOutput
from phloem.runtime.scheduler.batch import ScheduledBatch, write_decode_slots
from phloem.runtime.scheduler.req import Req
from phloem.runtime.scheduler.steps.forward import launch_forward, process_rows

if TYPE_CHECKING:
    from phloem.runtime.scheduler.scheduler import Scheduler


def decode_fields(s: Scheduler, batch: ScheduledBatch, *, extend: int) -> ScheduledBatch:
    """Fill the per-row fields every decode step shares and count the step."""
    n = len(batch.reqs)
    batch.prefix_lens = [r.kv_len for r in batch.reqs]
    batch.extend_lens = [extend] * n
    batch.discard = [False] * n
    batch.chunk = [False] * n
    batch.prefill_row = [False] * n
    s.count_decode_launch(batch.decode_steps)
    return batch


def live_rows(s: Scheduler) -> list[Req]:
    """Running requests that still need a token."""
    return [r for r in s.running if r.wants_token]


class DecodeStep:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler

    def rows(self) -> tuple[list[Req], Any]:
        """Running requests that still need a token, after making room for one token each, and
        their decode index (``write_decode_slots``)."""
        s = self.s
        reqs = live_rows(s)
        if not reqs:
            return [], None
        if s.cache.available_size < len(reqs):
            s.sync_inflight()
            reqs = live_rows(s)
            if s.cache.available_size < len(reqs):
                s.retract_until(len(reqs))
                reqs = live_rows(s)
        slots = s.cache.alloc(len(reqs))
        if slots is None:
            raise RuntimeError("KV pool accounting error: no slot for a decode step after retraction")
        index = write_decode_slots(s.req_pool.req_to_token, reqs, slots)
        for req in reqs:
            req.extend_len = 1  # Req.extend_len: new tokens in the pass being built
        return reqs, index

    def schedule(self) -> ScheduledBatch | None:
        reqs, index = self.rows()
        if not reqs:
            return None
        batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=reqs, decode_index=index, kind=self)
        return decode_fields(self.s, batch, extend=1)

    def launch(self, batch: ScheduledBatch, vocab_mask: Any) -> Future[Any]:
        return launch_forward(self.s, batch, vocab_mask)

    def process(self, batch: ScheduledBatch, fut: Future[Any]) -> None:
        s = self.s
        out = fut.result()
        tokens = out.synchronize()
        s.pace.decode_processed(out.step_time)
        # Requests that finished while this step was queued are released now that it is done.
        s.release_deferred()
        if self.is_plain(batch, out):
            self.process_plain_rows(batch.reqs, tokens)
        else:
            process_rows(s, batch, out, tokens)
        s.finish_decode(len(batch.reqs))

    def is_plain(self, batch: ScheduledBatch, out: ForwardOutput) -> bool:
        """Every row decodes one kept token, with no logprobs and no drafter to follow."""
        return out.logprobs is None and self.s.spec is None

    def process_plain_rows(self, reqs: list[Req], tokens: list[int]) -> None:
        """``process_rows`` for a plain decode step (the per-row work at large batch): no row is a
        prefill row or discarded, and there are no logprobs or drafter."""
        append = self.s.append_token
        for req, token in zip(reqs, tokens):
            req.pending_outputs -= 1
            # the attribute first: a method call per row costs this loop more than the test
            if not ((req.stale_outputs and req.drop_stale(1)) or req.finished):
                append(req, token, None)
