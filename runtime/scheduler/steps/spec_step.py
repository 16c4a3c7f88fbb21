"""One speculative step: draft a tree for every row, verify them all in one target pass."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from phloem.runtime.forward_io import ForwardMode
from phloem.runtime.scheduler.batch import ScheduledBatch
from phloem.runtime.scheduler.protocols import Speculative
from phloem.runtime.scheduler.steps.decode import decode_fields, live_rows

if TYPE_CHECKING:
    from phloem.runtime.scheduler.scheduler import Scheduler


def all_eligible(s: Scheduler, spec: Speculative) -> bool:
    """Whether every running request may decode speculatively (else plain decode runs)."""
    return all(
        spec.eligible(r.params, wants_logprobs=r.return_logprob, num_outputs=len(r.output_ids))
        for r in s.running if not r.finished
    )  # fmt: skip


def run_inline(call: Any, *args: Any) -> Future[Any]:
    """``call(*args)`` now, as a completed future; an error reaches the loop like a failed forward."""
    fut: Future[Any] = Future()
    try:
        fut.set_result(call(*args))
    except BaseException as e:
        fut.set_exception(e)
    return fut


class SpecStep:
    def __init__(self, scheduler: Scheduler, spec: Speculative) -> None:
        self.s = scheduler
        self.spec = spec

    def schedule(self) -> ScheduledBatch | None:
        """Drafts first, then one allocation for every tree node of the step; rejected nodes'
        slots come back right after the verify pass (``process``)."""
        from phloem.runtime.speculative.step import SpecRow

        s, spec = self.s, self.spec
        if not all_eligible(s, spec):
            return None
        reqs = live_rows(s)
        if reqs and s.cache.available_size < spec.max_tree * len(reqs):
            s.retract_until(spec.max_tree * len(reqs), per_request=spec.max_tree)
            reqs = live_rows(s)
        if not reqs:
            return None
        whole = spec.needs_context  # n-gram drafts read the whole context; EAGLE its newest token
        rows = [
            SpecRow(
                r.req_pool_idx,
                r.kv_len,
                r.fill_ids if whole else [r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1]],
                spec.sampling_of(r.params),
                r.remaining_new_tokens,
                grammar=r.grammar,
            )
            for r in reqs
        ]
        slots = s.cache.alloc(spec.plan(rows))
        if slots is None:
            raise RuntimeError("KV pool accounting error: no slots for a speculative step after retraction")
        batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=reqs, spec_rows=rows, spec_slots=slots, kind=self)
        return decode_fields(s, batch, extend=0)  # kv_len advances by each accept length, once known

    def launch(self, batch: ScheduledBatch, vocab_mask: Any) -> Future[Any]:
        """Draft trees were grown in ``schedule``; the verify pass runs here, in line."""
        fut = run_inline(self.spec.verify, batch.spec_rows, batch.spec_slots)
        for req in batch.reqs:
            req.pending_outputs += 1
        return fut

    def process(self, batch: ScheduledBatch, fut: Future[Any]) -> None:
        """Commit each request's accepted tokens: free rejected slots now, advance ``kv_len`` by
        the accept length, append the tokens and check stops over all of them at once."""
        s = self.s
        results = fut.result()
        s.release_deferred()
        for req, res in zip(batch.reqs, results):
            s.cache.free_slots(res.free_slots)
            req.kv_len += res.accept_length
            req.pending_outputs -= 1
            req.spec_verify_ct += 1
            req.spec_accepted_tokens += res.accept_length
            req.spec_draft_budget += self.spec.max_tree - 1
            if not req.finished:
                s.append_tokens(req, res.tokens)
        s.finish_decode(sum(len(r.tokens) for r in results))
