"""Continuous decode: several decode steps launched as one (``--num-continuous-decode-steps``).

The host launches the steps back to back and reads their tokens together, so its per-step work
is paid once for all of them.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from phloem.runtime.forward_io import ForwardMode
from phloem.runtime.scheduler.batch import ScheduledBatch, write_decode_slots
from phloem.runtime.scheduler.req import Req
from phloem.runtime.scheduler.steps.decode import decode_fields, live_rows
from phloem.runtime.scheduler.steps.forward import launch_forward

if TYPE_CHECKING:
    from phloem.runtime.scheduler.scheduler import Scheduler


class ContinuousDecodeStep:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler

    def steps_for(self, reqs: list[Req]) -> int:
        """Decode steps to launch as one batch of the decoding rows ``reqs``: only under the
        conditions of ``Scheduler.unseen_steps`` and when every step's slots are free now."""
        s = self.s
        steps = s.unseen_steps(reqs, self.step_cap())
        if steps <= 1 or s.cache.available_size < steps * len(reqs):
            return 1
        return steps

    def step_cap(self) -> int:
        """The most steps one launch may carry: ``decode_steps``, or what fits the budget at the
        measured pace."""
        s = self.s
        if s.cfg.decode_budget_s > 0:
            return s.pace.steps_within(s.cfg.decode_budget_s, s.cfg.decode_steps)
        return s.cfg.decode_steps

    def schedule(self) -> ScheduledBatch | None:
        """The decoding rows with a slot for each step, or None when one step at a time is due."""
        s = self.s
        reqs = live_rows(s)
        steps = self.steps_for(reqs)
        if steps <= 1:
            return None
        slots = s.cache.alloc(len(reqs) * steps)
        if slots is None:
            raise RuntimeError("KV pool accounting error: no slots for a continuous decode batch")
        index = write_decode_slots(s.req_pool.req_to_token, reqs, slots, steps)
        for req in reqs:
            req.extend_len = 1
        batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=reqs, decode_index=index, decode_steps=steps, kind=self)
        batch.step_slots = slots.view(len(reqs), steps).T.contiguous()  # [steps, B]
        s.stats.continuous_decode_steps += steps
        return decode_fields(s, batch, extend=1)

    def launch(self, batch: ScheduledBatch, vocab_mask: Any) -> Future[Any]:
        return launch_forward(self.s, batch, vocab_mask)

    def process(self, batch: ScheduledBatch, fut: Future[Any]) -> None:
        """Each row's tokens from every step, appended at once; stops are checked over all of
        them, and tokens past a stop are dropped (their KV slots are freed with the request,
        past ``kv_len``'s known tokens)."""
        s = self.s
        out = fut.result()
        per_step = out.synchronize_steps()
        s.pace.decode_processed(out.step_time)
        s.release_deferred()
        steps = len(per_step)
        kept = 0
        for r, req in enumerate(batch.reqs):
            req.pending_outputs -= steps
            if not (req.drop_stale(steps) or req.finished):
                before = len(req.output_ids)
                s.append_tokens(req, [tokens[r] for tokens in per_step])
                kept += len(req.output_ids) - before
        s.finish_decode(kept, steps=steps)
