"""A speculative window: EAGLE chain steps run on the device back to back, read back once
(``--num-continuous-decode-steps`` of them, see :mod:`phloem.runtime.speculative.window`)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from phloem.runtime.forward_io import ForwardMode
from phloem.runtime.scheduler.batch import ScheduledBatch, write_decode_slots
from phloem.runtime.scheduler.protocols import Speculative
from phloem.runtime.scheduler.req import Req
from phloem.runtime.scheduler.steps.decode import decode_fields, live_rows
from phloem.runtime.scheduler.steps.spec_step import all_eligible, run_inline

if TYPE_CHECKING:
    from phloem.runtime.scheduler.scheduler import Scheduler


class SpecWindowStep:
    def __init__(self, scheduler: Scheduler, spec: Speculative) -> None:
        self.s = scheduler
        self.spec = spec

    def steps_for(self, reqs: list[Req]) -> int:
        """Chain steps of a window over ``reqs``: under the conditions of continuous decode
        (``Scheduler.unseen_steps``), halved until every row's slots are free now; 0 for none."""
        s, window = self.s, self.spec.window
        steps = s.unseen_steps(reqs, min(s.cfg.decode_steps, window.max_steps))
        width = s.req_pool.req_to_token.shape[1]
        while steps >= 1 and (
            s.cache.available_size < len(reqs) * window.slots_per_row(steps)
            or max(r.kv_len for r in reqs) + window.slots_per_row(steps) > width
        ):
            steps //= 2
        return max(steps, 0)

    def schedule(self) -> ScheduledBatch | None:
        """The window's batch, or None (one speculative step at a time) when no window fits."""
        s, window = self.s, self.spec.window
        if window is None or s.cfg.decode_steps <= 1 or not all_eligible(s, self.spec):
            return None
        reqs = live_rows(s)
        if not window.fits(len(reqs)):
            return None
        steps = self.steps_for(reqs)
        if steps < 1:
            return None
        span = window.slots_per_row(steps)
        slots = s.cache.alloc(len(reqs) * span)
        if slots is None:
            raise RuntimeError("KV pool accounting error: no slots for a speculative window")
        write_decode_slots(s.req_pool.req_to_token, reqs, slots, span)
        batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=reqs, spec_slots=slots, spec_window=steps, kind=self)
        s.stats.spec_window_steps += steps
        return decode_fields(s, batch, extend=0)  # kv_len advances once the tokens are read

    def launch(self, batch: ScheduledBatch, vocab_mask: Any) -> Future[Any]:
        """The window's steps run here, in line; their tokens are read back once at its end."""
        from phloem.runtime.speculative.window import WindowRow

        spec = self.spec
        rows = [
            WindowRow(r.req_pool_idx, r.kv_len, r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1],
                      spec.sampling_of(r.params))
            for r in batch.reqs
        ]  # fmt: skip
        fut = run_inline(spec.run_window, rows, batch.spec_window)
        for req in batch.reqs:
            req.pending_outputs += 1
        return fut

    def process(self, batch: ScheduledBatch, fut: Future[Any]) -> None:
        """Each row's tokens from every step of a window: ``kv_len`` advances by all of them and
        the window slots past it are freed (before any deferred release, which frees the row's
        first ``kv_len``); stops are checked over the tokens in order and what follows a stop is
        dropped, as in continuous decode."""
        s = self.s
        result = fut.result()
        assert batch.spec_slots is not None
        span = batch.spec_slots.numel() // len(batch.reqs)
        spare = []
        for r, req in enumerate(batch.reqs):
            total = result.total(r)
            spare.append(batch.spec_slots[r * span + total : (r + 1) * span])
            req.kv_len = batch.prefix_lens[r] + total
        s.cache.free_slots(torch.cat(spare))
        s.release_deferred()
        kept = 0
        for r, req in enumerate(batch.reqs):
            req.pending_outputs -= 1
            if not req.finished:
                kept += self._commit(req, result.tokens[r])
        s.finish_decode(kept)

    def _commit(self, req: Req, per_step: list[list[int]]) -> int:
        """Append one row's tokens and count its accept length; returns the tokens kept."""
        before = len(req.output_ids)
        self.s.append_tokens(req, [t for step in per_step for t in step])
        new = len(req.output_ids) - before
        used, seen = 0, 0  # steps whose tokens were kept, for the request's accept length
        while seen < new and used < len(per_step):
            seen += len(per_step[used])
            used += 1
        req.spec_verify_ct += max(used, 1)
        req.spec_accepted_tokens += new
        req.spec_draft_budget += (self.spec.max_tree - 1) * max(used, 1)
        return new
