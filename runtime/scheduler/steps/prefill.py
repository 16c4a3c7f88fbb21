"""Prefill: admit waiting requests into one extend pass (continued chunks and jump-forward
requests first), optionally with a decode token for every running request (mixed chunk)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from phloem.runtime.forward_io import ForwardMode
from phloem.runtime.host_copy import to_device
from phloem.runtime.scheduler.admission_report import prefix_report
from phloem.runtime.scheduler.batch import ScheduledBatch
from phloem.runtime.scheduler.policy import order_waiting, should_defer_sibling
from phloem.runtime.scheduler.prefill_adder import AddResult, PrefillAdder
from phloem.runtime.scheduler.req import Req
from phloem.runtime.scheduler.steps.forward import launch_forward, process_rows

if TYPE_CHECKING:
    from phloem.runtime.scheduler.scheduler import Scheduler


class PrefillStep:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> ScheduledBatch | None:
        s = self.s
        if not s.waiting and s.chunked is None and not s.jumped:
            return None
        adder = self._adder()
        self._continue_jumped(adder)
        self._continue_chunked(adder)
        admitted = self._admit_waiting(adder)
        if not adder.can_run:
            return None
        for req in admitted:
            s.waiting.remove(req)
        return self._batch(adder)

    def _adder(self) -> PrefillAdder:
        s = self.s
        running_cap = s.cfg.max_running_requests - len(s.running) - len(s.jumped)
        return PrefillAdder(
            available_tokens=s.cache.available_size,
            running=[*s.running, *s.jumped, *([s.chunked] if s.chunked else [])],
            new_token_ratio=s.ratio.value,
            max_prefill_tokens=s.cfg.max_prefill_tokens,
            chunk_size=s.cfg.chunked_prefill_size,
            max_new_reqs=max(running_cap, 0) + (1 if s.chunked else 0) + len(s.jumped),
        )

    def _continue_jumped(self, adder: PrefillAdder) -> None:
        """Requests whose output grew by jump-forward extend their forced tokens first."""
        s = self.s
        jumped, s.jumped = s.jumped, []
        for req in jumped:
            if req.finished:
                s.finish_dropped(req)
            elif req.stale_outputs:  # a launch of it from before the jump is still in flight
                s.jumped.append(req)
            elif adder.takes_tokens and s.chunked is None:
                adder.add_chunked(req)  # its forced tokens; continues as a chunk if cut
                if not self._alloc_extend(req):
                    adder.withdraw(req)
                    s.finish_dropped(req)
            else:
                s.jumped.append(req)

    def _continue_chunked(self, adder: PrefillAdder) -> None:
        """The request cut by the last prefill pass continues before anything is admitted."""
        s = self.s
        if s.chunked is None:
            return
        req, s.chunked = s.chunked, None
        if req.finished:
            s.finish_dropped(req)
            return
        adder.add_chunked(req)
        if not self._alloc_extend(req):
            adder.withdraw(req)
            s.finish_dropped(req)

    def _admit_waiting(self, adder: PrefillAdder) -> list[Req]:
        """Offer waiting requests in policy order until the adder is full or one does not fit;
        returns those admitted."""
        s = self.s
        order = order_waiting(
            s.waiting,
            policy=s.cfg.schedule_policy,
            prefix_len_of=self.match,
            use_priority=s.cfg.enable_priority_scheduling,
        )
        admitted: list[Req] = []
        # Waiting for a sibling pays only if the shared part can then be read from the tree.
        computing = s.prompts_in_flight() if s.cache.radix_enabled else None
        for req in order:
            if adder.full:
                break
            if req.pending_outputs:  # retracted while a step was in flight: wait for its token
                continue
            if req.prompt_len > s.cache.total_size:
                s.abort_unfittable(req, "the prompt is longer than the KV cache pool")
                continue
            self.match(req)
            # adder.can_run: admitted this round, a continued chunk included
            if computing is not None and should_defer_sibling(req, [*adder.can_run, *computing]):
                continue
            if not s.cache.prefetch_ready(req.match):
                continue  # its prefix is still arriving from the storage tier
            result = self._try_admit(req, adder)
            if result == AddResult.NO_TOKEN and s.preempt_for(req, adder):
                result = self._try_admit(req, adder)
            if result != AddResult.ADDED:
                break
            admitted.append(req)
        return admitted

    def _try_admit(self, req: Req, adder: PrefillAdder) -> AddResult:
        s = self.s
        before = s.cache.available_size
        req.match = s.cache.load_back(req.match)  # host-tier part of the prefix -> device slots
        req.handle = s.cache.acquire(req.match, extra_key=req.extra_key)
        lock_cost = before - s.cache.available_size
        adder.charge(lock_cost)
        alone = not s.running and not adder.can_run and s.chunked is None
        result = adder.add(req, allow_chunk=not req.wants_input_logprobs)
        if result == AddResult.NO_TOKEN and alone:
            # Nothing else runs: admit it if its next pass fits at all; retraction or an abort
            # handles it later if its output outgrows the pool.
            adder.lift_forecast()
            result = adder.add(req, allow_chunk=not req.wants_input_logprobs)
        if result != AddResult.ADDED:
            self._drop_handle(req)
            adder.credit(lock_cost)
            return result
        if not self._alloc_row_and_extend(req):
            adder.withdraw(req)
            self._drop_handle(req)
            return AddResult.NO_TOKEN
        if not req.first_admitted:
            req.first_admitted = True
            req.cached_tokens = req.prefix_len
            req.cached_tokens_details = s.cache.record_hit(req.match)
            s.stats.prompt_tokens += req.prompt_len
            s.stats.cached_tokens += min(req.prefix_len, req.prompt_len)
            if req.return_prefix_report:
                req.prefix_report = prefix_report(
                    s.cache.tree, req.origin_input_ids, extra_key=req.extra_key, cached_tokens=req.cached_tokens
                )
        return AddResult.ADDED

    def match(self, req: Req) -> int:
        """The request's cached prefix length (looked up again unless it holds a lock)."""
        if req.handle is None:
            req.match = self.s.cache.match(req.fill_ids, extra_key=req.extra_key, max_len=req.match_cap())
        return req.prefix_len

    def _drop_handle(self, req: Req) -> None:
        self.s.cache.unlock(req.handle.node)
        req.handle = None

    def _alloc_row_and_extend(self, req: Req) -> bool:
        s = self.s
        row = s.req_pool.alloc()
        if row is None:
            return False
        slots = s.cache.alloc(req.extend_len)
        if slots is None:
            s.req_pool.free(row)
            return False
        req.req_pool_idx = row
        table = s.req_pool.req_to_token
        row_slots = torch.cat((req.match.slots[: req.prefix_len], slots)) if req.prefix_len else slots
        table[row, : req.prefix_len + req.extend_len] = to_device(row_slots, table.device)  # one copy
        req.kv_len = req.prefix_len
        return True

    def _alloc_extend(self, req: Req) -> bool:
        """Slots for the next chunk of a request already holding a row (promised at admission).
        Returns False when the request had to be aborted because even alone it does not fit."""
        s = self.s
        slots = s.cache.alloc(req.extend_len)
        if slots is None:  # the forecast failed: retract others until it fits
            s.retract_until(req.extend_len, protect=req)
            slots = None if req.finished else s.cache.alloc(req.extend_len)
            if slots is None:
                req.finish(s.too_big())
                return False
        table = s.req_pool.req_to_token
        table[req.req_pool_idx, req.kv_len : req.kv_len + req.extend_len] = to_device(slots, table.device)
        return True

    def _batch(self, adder: PrefillAdder) -> ScheduledBatch:
        s = self.s
        reqs = adder.can_run
        batch = ScheduledBatch(mode=ForwardMode.EXTEND, reqs=list(reqs), kind=self)
        for req in reqs:
            wants_logprobs = req.wants_input_logprobs
            self._row(batch, req, req.extend_len, discard=req.is_chunked or req.params.max_new_tokens == 0,
                      chunk=req.is_chunked, prefill=True,
                      logprob_from=max(req.logprob_start_len, 0) if wants_logprobs else -1)  # fmt: skip
        if s.cfg.enable_mixed_chunk and s.running:
            decode, _ = s.decode_step.rows()
            for req in decode:
                batch.reqs.append(req)
                self._row(batch, req, 1, discard=False, chunk=False, prefill=False, logprob_from=-1)
        s.chunked = adder.new_chunked
        return batch

    @staticmethod
    def _row(
        batch: ScheduledBatch, req: Req, extend: int, *, discard: bool, chunk: bool, prefill: bool, logprob_from: int
    ) -> None:
        batch.prefix_lens.append(req.kv_len)
        batch.extend_lens.append(extend)
        batch.discard.append(discard)
        batch.chunk.append(chunk)
        batch.prefill_row.append(prefill)
        batch.input_logprob_from.append(logprob_from)

    # ------------------------------------------------------------------ launch and process
    def launch(self, batch: ScheduledBatch, vocab_mask: Any) -> Future[Any]:
        return launch_forward(self.s, batch, vocab_mask)

    def process(self, batch: ScheduledBatch, fut: Future[Any]) -> None:
        s = self.s
        out = fut.result()
        tokens = out.synchronize()
        # Requests that finished while this step was queued are released now that it is done.
        s.release_deferred()
        process_rows(s, batch, out, tokens)
        s.finish_prefill(batch)
