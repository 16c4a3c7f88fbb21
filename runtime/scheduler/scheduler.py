"""The scheduler loop (docs/design.md §4): receive, schedule, run, process.

CPU bookkeeping only. The loop reads aloud::

    while running:
        receive()                      # new requests, aborts, control messages
        batch = schedule()             # a prefill batch if the adder admits anything, else decode
        launch(batch)                  # hand it to the worker (inline or on a thread)
        process(previous results)      # overlap: the results of the step before this one

Without overlap, ``process`` handles the step just launched. With overlap, step N+1 is launched
before step N's tokens are looked at; N+1's inputs refer to N's tokens through future ids, and
requests finished at N free their memory only once N+1 is done (it still reads their rows).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from phloem.runtime.executor.forward_io import ForwardMode, ForwardOutput
from phloem.runtime.host_copy import to_device
from phloem.runtime.sampling.stop import FinishReason
from phloem.runtime.scheduler.batch import (
    ScheduledBatch,
    build_forward_input,
    gather_new_tokens,
    write_decode_slots,
)
from phloem.runtime.scheduler.output import OutputCollector
from phloem.runtime.scheduler.policy import (
    DecodePace,
    NewTokenRatio,
    decodes_ahead,
    order_waiting,
    ratio_after_retraction,
    retraction_order,
    should_defer_sibling,
)
from phloem.runtime.scheduler.prefill_adder import AddResult, PrefillAdder, charged_future_tokens
from phloem.runtime.scheduler.protocols import Cache, Grammar, ReqPool, Sampling, Speculative, Worker
from phloem.runtime.scheduler.req import Req

logger = logging.getLogger("phloem.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int | None
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    enable_mixed_chunk: bool = False
    enable_priority_scheduling: bool = False
    priority_preemption_threshold: int = 10
    overlap: bool = True
    stream_interval: int = 1
    log_interval: int = 40
    enable_jump_forward: bool = False
    # Decode steps launched as one (``--num-continuous-decode-steps``): see ``_continuous_steps``.
    decode_steps: int = 1
    # Device time such a launch may take, in seconds (0: always ``decode_steps``): see
    # ``policy.continuous_decode_plan``.
    decode_budget_s: float = 0.0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        *,
        cache: Cache,
        req_pool: ReqPool,
        worker: Worker,
        sampling: Sampling,
        outputs: OutputCollector,
        grammar: Grammar | None = None,
        spec: Speculative | None = None,  # needs overlap off
    ) -> None:
        self.cfg = config
        self.cache = cache
        self.req_pool = req_pool
        self.worker = worker
        self.sampling = sampling
        self.outputs = outputs
        self.grammar = grammar
        self.spec = spec
        if spec is not None and config.overlap:
            raise ValueError("speculative decoding runs the non-overlap loop (drafts need the last token)")
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        # Requests whose output grew by jump-forward: their new tokens are extended next prefill.
        self.jumped: list[Req] = []
        self._jump_pending: list[tuple[Req, int]] = []
        # Requests with a prompt pass launched and not processed (that part is not in the tree
        # yet), with the number of such passes: with overlap, chunk k + 1 of a prompt is launched
        # before chunk k is processed.
        self._prefilling: dict[int, tuple[Req, int]] = {}
        self.ratio = NewTokenRatio(config.schedule_conservativeness)
        self.inflight: deque[tuple[ScheduledBatch, Future[ForwardOutput]]] = deque()
        self.release_after_inflight: list[Req] = []
        self.stats = SchedulerCounters()
        self.pace = DecodePace()
        self.clock = time.perf_counter  # replaceable in tests
        self.last_step = StepTimes("", 0, 0.0, 0.0, 0.0)
        self.record_step_times = False  # fill last_step each step (the loop trace turns it on)
        self._decode_steps = 0
        self._last_log = time.monotonic()
        self._tokens_since_log = 0

    @property
    def _spec(self) -> Speculative:
        assert self.spec is not None, "a speculative step kind without a speculative step"
        return self.spec

    @property
    def _grammar(self) -> Grammar:
        assert self.grammar is not None, "a constrained request without a grammar queue"
        return self.grammar

    # ================================================================== entry points
    def add_request(self, req: Req) -> None:
        if self.grammar is not None and req.params.grammar is not None:
            self.grammar.add(req)  # waits there until its grammar compiles
            return
        self.waiting.append(req)

    def abort(
        self, rid: str | None, *, abort_all: bool = False, message: str = "aborted", status_code: int = 400
    ) -> None:
        reason = FinishReason.abort(message, status_code=status_code)
        for q in (self.waiting, self.grammar.pending if self.grammar else []):
            for req in [r for r in q if abort_all or r.rid == rid]:
                q.remove(req)
                req.finish(reason)
                self._release(req)
                self.outputs.add(req)
        for req in [*self.running, *([self.chunked] if self.chunked else [])]:
            if abort_all or req.rid == rid:
                req.finish(reason)  # leaves the batch when its in-flight step is processed
        if not self.inflight:
            self._drop_finished_running()
        self.outputs.flush()

    @property
    def is_idle(self) -> bool:
        return not (self.waiting or self.running or self.chunked or self.inflight or self.jumped) and not (
            self.grammar and self.grammar.pending
        )

    def flush_cache(self) -> bool:
        if not self.is_idle:
            return False
        return bool(self.cache.flush())

    # ================================================================== the loop
    def step(self) -> bool:
        """One iteration after messages were received. Returns False when there was nothing to do."""
        if self.grammar is not None:
            self.waiting.extend(self.grammar.ready(self))
        t0 = time.perf_counter()  # not self.clock: tests script that one
        batch = self.schedule()
        late_mask: Future[Any] | None = None
        t1 = time.perf_counter()
        if batch is not None:
            mask, late_mask = self._grammar_mask(batch)
            self.inflight.append((batch, self.launch(batch, mask)))
        t2 = time.perf_counter()
        # Without overlap: process what was just launched. With overlap: keep one step in flight,
        # except for a step whose requests may jump forward (that rewrites their KV tail).
        keep = 1 if (self.cfg.overlap and batch is not None and not self._may_jump(batch)) else 0
        while len(self.inflight) > keep:
            self._process_oldest()
        if self.record_step_times:  # what this step spent where (the scheduler process's loop trace)
            self.last_step = StepTimes(
                batch.mode.name if batch is not None else "",
                len(batch.reqs) if batch is not None else 0,
                t1 - t0,
                t2 - t1,
                time.perf_counter() - t2,
            )
        if late_mask is not None:
            # The step just launched needed tokens of the step just processed to know its mask;
            # its forward pass ran meanwhile and its sampler waits for this.
            assert batch is not None
            late_mask.set_result(self._grammar.fill_mask(batch.reqs))
        if batch is None and not self.inflight:
            self._release_deferred()
            self.pace.other_processed()  # idle: the next decode launch does not time this wait
            return False
        return True

    def drain(self) -> None:
        while self.inflight:
            self._process_oldest()
        self._release_deferred()

    # ================================================================== schedule
    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        if not self.waiting and self.chunked is None and not self.jumped:
            return None
        running_cap = self.cfg.max_running_requests - len(self.running) - len(self.jumped)
        charged = [*self.running, *self.jumped, *([self.chunked] if self.chunked else [])]
        adder = PrefillAdder(
            available_tokens=self.cache.available_size,
            running=charged,
            new_token_ratio=self.ratio.value,
            max_prefill_tokens=self.cfg.max_prefill_tokens,
            chunk_size=self.cfg.chunked_prefill_size,
            max_new_reqs=max(running_cap, 0) + (1 if self.chunked else 0) + len(self.jumped),
        )
        jumped, self.jumped = self.jumped, []
        for req in jumped:
            if req.finished:
                self._finish_chunked_abort(req)
            elif adder.takes_tokens and self.chunked is None:
                adder.add_chunked(req)  # its forced tokens; continues as a chunk if cut
                if not self._alloc_extend(req):
                    adder.withdraw(req)
                    self._finish_chunked_abort(req)
            else:
                self.jumped.append(req)
        if self.chunked is not None:
            req = self.chunked
            self.chunked = None
            if req.finished:
                self._finish_chunked_abort(req)
            else:
                adder.add_chunked(req)
                if not self._alloc_extend(req):
                    adder.withdraw(req)
                    self._finish_chunked_abort(req)
        order = order_waiting(
            self.waiting,
            policy=self.cfg.schedule_policy,
            prefix_len_of=self._match,
            use_priority=self.cfg.enable_priority_scheduling,
        )
        admitted_now: list[Req] = []
        # Waiting for a sibling pays only if the shared part can then be read from the tree.
        computing = self._prompts_in_flight() if self.cache.radix_enabled else None
        for req in order:
            if adder.full:
                break
            if req.pending_outputs:  # retracted while a step was in flight: wait for its token
                continue
            if req.prompt_len > self.cache.total_size:
                self._abort_unfittable(req, "the prompt is longer than the KV cache pool")
                continue
            self._match(req)
            # adder.can_run: admitted this round, a continued chunk included
            if computing is not None and should_defer_sibling(req, [*adder.can_run, *computing]):
                continue
            if not self.cache.prefetch_ready(req.match):
                continue  # its prefix is still arriving from the storage tier
            result = self._try_admit(req, adder)
            if result == AddResult.ADDED:
                admitted_now.append(req)
                continue
            if result == AddResult.NO_TOKEN and self._preempt_for(req, adder):
                if self._try_admit(req, adder) == AddResult.ADDED:
                    admitted_now.append(req)
                    continue
            break
        if not adder.can_run:
            return None
        for req in admitted_now:
            self.waiting.remove(req)
        return self._make_prefill_batch(adder)

    def _prompts_in_flight(self) -> list[Req]:
        """Requests whose prompt KV is still being computed, before this round's admissions: a
        prefill pass launched and not processed. Their prompt enters the tree once the last such
        pass is processed."""
        return [req for req, _ in self._prefilling.values()]

    def _try_admit(self, req: Req, adder: PrefillAdder) -> AddResult:
        before = self.cache.available_size
        req.match = self.cache.load_back(req.match)  # host-tier part of the prefix -> device slots
        req.handle = self.cache.acquire(req.match, extra_key=req.extra_key)
        lock_cost = before - self.cache.available_size
        adder.charge(lock_cost)
        alone = not self.running and not adder.can_run and self.chunked is None
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
            req.cached_tokens_details = self.cache.record_hit(req.match)
            self.stats.prompt_tokens += req.prompt_len
            self.stats.cached_tokens += min(req.prefix_len, req.prompt_len)
        return AddResult.ADDED

    def _match(self, req: Req) -> int:
        if req.handle is None:
            req.match = self.cache.match(req.fill_ids, extra_key=req.extra_key, max_len=req.match_cap())
        return req.prefix_len

    def _drop_handle(self, req: Req) -> None:
        self.cache.unlock(req.handle.node)
        req.handle = None

    def _alloc_row_and_extend(self, req: Req) -> bool:
        row = self.req_pool.alloc()
        if row is None:
            return False
        slots = self.cache.alloc(req.extend_len)
        if slots is None:
            self.req_pool.free(row)
            return False
        req.req_pool_idx = row
        table = self.req_pool.req_to_token
        row_slots = torch.cat((req.match.slots[: req.prefix_len], slots)) if req.prefix_len else slots
        table[row, : req.prefix_len + req.extend_len] = to_device(row_slots, table.device)  # one copy
        req.kv_len = req.prefix_len
        return True

    def _alloc_extend(self, req: Req) -> bool:
        """Slots for the next chunk of a request already holding a row (promised at admission).
        Returns False when the request had to be aborted because even alone it does not fit."""
        slots = self.cache.alloc(req.extend_len)
        if slots is None:  # the forecast failed: retract others until it fits
            self._retract_until(req.extend_len, protect=req)
            slots = None if req.finished else self.cache.alloc(req.extend_len)
            if slots is None:
                req.finish(_too_big())
                return False
        table = self.req_pool.req_to_token
        table[req.req_pool_idx, req.kv_len : req.kv_len + req.extend_len] = to_device(slots, table.device)
        return True

    def _make_prefill_batch(self, adder: PrefillAdder) -> ScheduledBatch:
        reqs = adder.can_run
        batch = ScheduledBatch(mode=ForwardMode.EXTEND, reqs=list(reqs))
        for req in reqs:
            batch.prefix_lens.append(req.kv_len)
            batch.extend_lens.append(req.extend_len)
            batch.discard.append(req.is_chunked or req.params.max_new_tokens == 0)
            batch.chunk.append(req.is_chunked)
            batch.prefill_row.append(True)
            batch.input_logprob_from.append(max(req.logprob_start_len, 0) if req.wants_input_logprobs else -1)
        if self.cfg.enable_mixed_chunk and self.running:
            decode, _ = self._decode_rows()
            if decode:
                for req in decode:
                    batch.reqs.append(req)
                    batch.prefix_lens.append(req.kv_len)
                    batch.extend_lens.append(1)
                    batch.discard.append(False)
                    batch.chunk.append(False)
                    batch.prefill_row.append(False)
                    batch.input_logprob_from.append(-1)
        self.chunked = adder.new_chunked
        return batch

    # ------------------------------------------------------------------ decode
    def _decode_rows(self) -> tuple[list[Req], Any]:
        """Running requests that still need a token, after making room for one token each."""
        reqs = [r for r in self.running if r.wants_token]
        if not reqs:
            return [], None
        if self.cache.available_size < len(reqs):
            self._sync_inflight()
            reqs = [r for r in self.running if r.wants_token]
            if self.cache.available_size < len(reqs):
                self._retract_until(len(reqs))
                reqs = [r for r in self.running if r.wants_token]
        slots = self.cache.alloc(len(reqs))
        if slots is None:
            raise RuntimeError("KV pool accounting error: no slot for a decode step after retraction")
        index = write_decode_slots(self.req_pool.req_to_token, reqs, slots)
        for req in reqs:
            req.extend_len = 1  # Req.extend_len: new tokens in the pass being built
        return reqs, index

    def _schedule_decode(self) -> ScheduledBatch | None:
        if self.spec is not None and self._all_spec_eligible():
            return self._schedule_spec_window() or self._schedule_spec_decode()
        if self.cfg.decode_steps > 1:
            live = [r for r in self.running if r.wants_token]
            steps = self._continuous_steps(live)
            if steps > 1:
                return self._continuous_batch(steps, live)
        reqs, index = self._decode_rows()
        if not reqs:
            return None
        batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=reqs, decode_index=index)
        return self._decode_batch(batch, extend=1)

    def _continuous_batch(self, steps: int, reqs: list[Req]) -> ScheduledBatch:
        """The decoding rows ``reqs``, with a slot for each of ``steps`` steps
        (``_continuous_steps`` checked they are free)."""
        slots = self.cache.alloc(len(reqs) * steps)
        if slots is None:
            raise RuntimeError("KV pool accounting error: no slots for a continuous decode batch")
        index = write_decode_slots(self.req_pool.req_to_token, reqs, slots, steps)
        for req in reqs:
            req.extend_len = 1
        batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=reqs, decode_index=index, decode_steps=steps)
        batch.step_slots = slots.view(len(reqs), steps).T.contiguous()  # [steps, B]
        self.stats.continuous_decode_steps += steps
        return self._decode_batch(batch, extend=1)

    def _continuous_steps(self, reqs: list[Req]) -> int:
        """Decode steps to launch as one batch of the decoding rows ``reqs``
        (``--num-continuous-decode-steps``): the host launches them back to back and reads their
        tokens together, so its per-step work is paid once for all of them. Only under the
        conditions of ``_unseen_steps`` and when every step's slots are free now."""
        if self.spec is not None:
            return 1
        cap = self.cfg.decode_steps
        if self.cfg.decode_budget_s > 0:
            cap = self.pace.steps_within(self.cfg.decode_budget_s, cap)
        steps = self._unseen_steps(reqs, cap)
        if steps <= 1 or self.cache.available_size < steps * len(reqs):
            return 1
        return steps

    def _unseen_steps(self, reqs: list[Req], steps: int) -> int:
        """How many steps the decoding rows ``reqs`` may take before the host sees their tokens
        (continuous decode, speculative windows), at most ``steps``; 0 when they may not: something
        waits to be admitted (it would wait the whole batch), a row needs the host between its
        tokens (``decodes_ahead``) or a grammar is still compiling. Never past any row's
        ``max_new_tokens``."""
        if not reqs or self.waiting or self.chunked is not None or self.jumped:
            return 0
        if self.grammar is not None and self.grammar.pending:
            return 0
        for req in reqs:
            if not decodes_ahead(req):
                return 0
            steps = min(steps, req.remaining_new_tokens)
        return steps

    def _decode_batch(self, batch: ScheduledBatch, *, extend: int) -> ScheduledBatch:
        """Fill the per-row fields every decode step shares and count the step."""
        n = len(batch.reqs)
        batch.prefix_lens = [r.kv_len for r in batch.reqs]
        batch.extend_lens = [extend] * n
        batch.discard = [False] * n
        batch.chunk = [False] * n
        batch.prefill_row = [False] * n
        for _ in range(batch.decode_steps):
            self.ratio.step()
        self._decode_steps += 1
        return batch

    def _all_spec_eligible(self) -> bool:
        return all(
            self._spec.eligible(r.params, wants_logprobs=r.return_logprob, num_outputs=len(r.output_ids))
            for r in self.running if not r.finished
        )  # fmt: skip

    def _schedule_spec_window(self) -> ScheduledBatch | None:
        """EAGLE chain steps run on the device back to back (``--num-continuous-decode-steps`` of
        them, see :mod:`phloem.runtime.speculative.window`), under the conditions of continuous
        decode (``_unseen_steps``), with every row's slots for the window free now (fewer steps
        when they are not). Otherwise None (one speculative step at a time)."""
        window = self._spec.window
        if window is None or self.cfg.decode_steps <= 1:
            return None
        reqs = [r for r in self.running if r.wants_token]
        if not window.fits(len(reqs)):
            return None
        steps = self._unseen_steps(reqs, min(self.cfg.decode_steps, window.max_steps))
        width = self.req_pool.req_to_token.shape[1]
        while steps >= 1 and (
            self.cache.available_size < len(reqs) * window.slots_per_row(steps)
            or max(r.kv_len for r in reqs) + window.slots_per_row(steps) > width
        ):
            steps //= 2
        if steps < 1:
            return None
        span = window.slots_per_row(steps)
        slots = self.cache.alloc(len(reqs) * span)
        if slots is None:
            raise RuntimeError("KV pool accounting error: no slots for a speculative window")
        write_decode_slots(self.req_pool.req_to_token, reqs, slots, span)
        batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=reqs, spec_slots=slots, spec_window=steps)
        self.stats.spec_window_steps += steps
        return self._decode_batch(batch, extend=0)  # kv_len advances once the tokens are read

    def _schedule_spec_decode(self) -> ScheduledBatch | None:
        """Drafts first, then one allocation for every tree node of the step; rejected nodes'
        slots come back right after the verify pass (``_process_spec``)."""
        from phloem.runtime.speculative.step import SpecRow

        def live() -> list[Req]:
            return [r for r in self.running if r.wants_token]

        reqs = live()
        if reqs and self.cache.available_size < self._spec.max_tree * len(reqs):
            self._retract_until(self._spec.max_tree * len(reqs), per_request=self._spec.max_tree)
            reqs = live()
        if not reqs:
            return None
        whole = self._spec.needs_context  # n-gram drafts read the whole context; EAGLE its newest token
        rows = [
            SpecRow(
                r.req_pool_idx,
                r.kv_len,
                r.fill_ids if whole else [r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1]],
                self._spec.sampling_of(r.params),
                r.remaining_new_tokens,
                grammar=r.grammar,
            )
            for r in reqs
        ]
        slots = self.cache.alloc(self._spec.plan(rows))
        if slots is None:
            raise RuntimeError("KV pool accounting error: no slots for a speculative step after retraction")
        batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=reqs, spec_rows=rows, spec_slots=slots)
        return self._decode_batch(batch, extend=0)  # kv_len advances by each accept length, once known

    # ------------------------------------------------------------------ launch
    def _grammar_mask(self, batch: ScheduledBatch) -> tuple[Any, Future[Any] | None]:
        """The batch's grammar bitmask now, or a future filled after the in-flight step is
        processed (when a constrained row's previous token is still in flight)."""
        if self.grammar is None or not any(r.grammar is not None for r in batch.reqs):
            return None, None
        if any(r.grammar is not None and r.pending_outputs for r in batch.reqs):
            fut: Future[Any] = Future()
            return fut, fut
        return self._grammar.fill_mask(batch.reqs), None

    def launch(self, batch: ScheduledBatch, vocab_mask: Any = None) -> Future[Any]:
        if batch.spec_window:
            return self._launch_spec_window(batch)
        if batch.spec_rows is not None:
            return self._launch_spec(batch)
        future_ids = self.worker.future_map.reserve(len(batch.reqs))
        ids = gather_new_tokens(batch)
        sampling = self.sampling.build(batch.reqs, vocab_mask=vocab_mask)
        fi = build_forward_input(
            batch, req_to_token=self.req_pool.req_to_token, input_ids=ids, sampling=sampling
        )
        # EAGLE follows every computed token: plain passes return the target's hidden states
        fi.return_hidden_states = self.spec is not None and self._spec.needs_hidden
        batch.future_ids = future_ids
        is_prefill = batch.is_prefill
        steps = batch.decode_steps  # tokens per row: each step computes one and samples one
        rows = zip(batch.reqs, batch.extend_lens, batch.discard, batch.prefill_row, future_ids, strict=True)
        for req, extend, discard, prefill_row, future in rows:
            req.kv_len += extend * steps
            if not discard:
                req.pending_outputs += steps
                req.future_ref = future  # the last step's token
            if prefill_row:
                passes = self._prefilling.get(id(req), (req, 0))[1]
                self._prefilling[id(req)] = (req, passes + 1)
            # A request whose prefill completes joins the running set now, so the next step
            # (which may be launched before this one is processed) already decodes it.
            if is_prefill and not discard and req not in self.running:
                self.running.append(req)
        return self.worker.submit(fi, future_ids)

    def _launch_spec(self, batch: ScheduledBatch) -> Future[Any]:
        """Draft trees were grown in ``schedule``; the verify pass runs here, in line."""
        fut: Future[Any] = Future()
        try:
            fut.set_result(self._spec.verify(batch.spec_rows, batch.spec_slots))
        except BaseException as e:  # surfaced to the loop like a failed forward
            fut.set_exception(e)
        for req in batch.reqs:
            req.pending_outputs += 1
        return fut

    def _launch_spec_window(self, batch: ScheduledBatch) -> Future[Any]:
        """The window's steps run here, in line; their tokens are read back once at its end."""
        from phloem.runtime.speculative.window import WindowRow

        rows = [
            WindowRow(r.req_pool_idx, r.kv_len, r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1],
                      self._spec.sampling_of(r.params))
            for r in batch.reqs
        ]  # fmt: skip
        fut: Future[Any] = Future()
        try:
            fut.set_result(self._spec.run_window(rows, batch.spec_window))
        except BaseException as e:  # surfaced to the loop like a failed forward
            fut.set_exception(e)
        for req in batch.reqs:
            req.pending_outputs += 1
        return fut

    # ================================================================== process
    def _process_oldest(self) -> None:
        batch, fut = self.inflight.popleft()
        if batch.spec_window:
            self._process_spec_window(batch, fut.result())
            return
        if batch.spec_rows is not None:
            self._process_spec(batch, fut.result())
            return
        out = fut.result()
        if batch.decode_steps > 1:
            per_step = out.synchronize_steps()
            self.pace.decode_processed(self.clock(), batch.decode_steps)
            self._process_continuous(batch, per_step)
            return
        tokens = out.synchronize()
        if batch.mode == ForwardMode.DECODE:
            self.pace.decode_processed(self.clock(), 1)
        else:
            self.pace.other_processed()
        # Requests that finished while this step was queued are released now that it is done.
        self._release_deferred()
        if self._is_plain_decode(batch, out):
            self._process_decode_rows(batch.reqs, tokens)
        else:
            self._process_rows(batch, out, tokens)
        if batch.mode == ForwardMode.DECODE:
            self._finish_decode(len(batch.reqs))
        else:
            self._finish_step()
            self.stats.prefill_batches += 1
            self._log_prefill(batch)

    def _finish_decode(self, new_tokens: int, steps: int = 1) -> None:
        """The tail of processing a decode step of any kind: finished requests leave, outputs go
        out, and every ``log_interval`` launches a log line (``steps``: steps of this launch)."""
        self._finish_step()
        self._tokens_since_log += new_tokens
        if self._decode_steps % self.cfg.log_interval == 0:
            self._log_decode(steps)

    def _finish_step(self) -> None:
        self._apply_jumps()  # nothing to do unless a row jumped forward
        self._drop_finished_running()
        self.outputs.flush()

    def _process_continuous(self, batch: ScheduledBatch, per_step: list[list[int]]) -> None:
        """A continuous decode batch: each row's tokens from every step, appended at once; stops
        are checked over all of them, and tokens past a stop are dropped (their KV slots are
        freed with the request, past ``kv_len``'s known tokens)."""
        self._release_deferred()
        steps = len(per_step)
        kept = 0
        for r, req in enumerate(batch.reqs):
            req.pending_outputs -= steps
            if not req.finished:
                before = len(req.output_ids)
                self._append_tokens(req, [tokens[r] for tokens in per_step])
                kept += len(req.output_ids) - before
        self._finish_decode(kept, steps)

    def _is_plain_decode(self, batch: ScheduledBatch, out: ForwardOutput) -> bool:
        """Every row decodes one kept token, with no logprobs and no drafter to follow."""
        return batch.mode == ForwardMode.DECODE and out.logprobs is None and self.spec is None

    def _process_decode_rows(self, reqs: list[Req], tokens: list[int]) -> None:
        """``_process_rows`` for a plain decode step (the per-row work at large batch): no row is a
        prefill row or discarded, and there are no logprobs or drafter."""
        for req, token in zip(reqs, tokens):
            req.pending_outputs -= 1
            if not req.finished:
                self._append_token(req, token, None)

    def _prefill_processed(self, req: Req) -> None:
        _, passes = self._prefilling.pop(id(req), (req, 0))
        if passes > 1:
            self._prefilling[id(req)] = (req, passes - 1)

    def _process_rows(self, batch: ScheduledBatch, out: ForwardOutput, tokens: list[int]) -> None:
        """Each row's result: discarded rows, prefill rows entering the tree, logprobs, the drafter."""
        plain: list[tuple[int, int, Any]] = []  # (row, token, feature) of plain decode rows, for the drafter
        for i, req in enumerate(batch.reqs):
            if batch.prefill_row[i]:
                self._prefill_processed(req)
            lp = out.logprobs[i] if out.logprobs is not None else None
            if self.spec is not None:
                self._follow_spec(batch, i, req, tokens[i], out, plain)
            if batch.discard[i]:
                self._after_discarded_row(
                    req,
                    lp,
                    is_chunk=batch.chunk[i],
                    batch_prefix=batch.prefix_lens[i],
                    batch_extend=batch.extend_lens[i],
                )
                continue
            req.pending_outputs -= 1
            if req.finished:
                continue
            if batch.prefill_row[i]:
                self._share_prefix(req, batch.prefix_lens[i] + batch.extend_lens[i])
            self._append_token(req, tokens[i], lp)
        if plain:
            self._spec.on_plain_steps(*map(list, zip(*plain)))  # one catch-up pass for every row

    def _process_spec(self, batch: ScheduledBatch, results: list[Any]) -> None:
        """Commit each request's accepted tokens: free rejected slots now, advance ``kv_len`` by the
        accept length, append the tokens and check stops over all of them at once."""
        self._release_deferred()
        for req, res in zip(batch.reqs, results):
            self.cache.free_slots(res.free_slots)
            req.kv_len += res.accept_length
            req.pending_outputs -= 1
            req.spec_verify_ct += 1
            req.spec_accepted_tokens += res.accept_length
            req.spec_draft_budget += self._spec.max_tree - 1
            if not req.finished:
                self._append_tokens(req, res.tokens)
        self._finish_decode(sum(len(r.tokens) for r in results))

    def _process_spec_window(self, batch: ScheduledBatch, result: Any) -> None:
        """Each row's tokens from every step of a window: ``kv_len`` advances by all of them and
        the window slots past it are freed (before any deferred release, which frees the row's
        first ``kv_len``); stops are checked over the tokens in order and what follows a stop is
        dropped, as in continuous decode."""
        assert batch.spec_slots is not None
        span = batch.spec_slots.numel() // len(batch.reqs)
        spare = []
        for r, req in enumerate(batch.reqs):
            total = result.total(r)
            spare.append(batch.spec_slots[r * span + total : (r + 1) * span])
            req.kv_len = batch.prefix_lens[r] + total
        self.cache.free_slots(torch.cat(spare))
        self._release_deferred()
        kept = 0
        for r, req in enumerate(batch.reqs):
            req.pending_outputs -= 1
            if req.finished:
                continue
            per_step = result.tokens[r]
            before = len(req.output_ids)
            self._append_tokens(req, [t for step in per_step for t in step])
            new = len(req.output_ids) - before
            used, seen = 0, 0  # steps whose tokens were kept, for the request's accept length
            while seen < new and used < len(per_step):
                seen += len(per_step[used])
                used += 1
            req.spec_verify_ct += max(used, 1)
            req.spec_accepted_tokens += new
            req.spec_draft_budget += (self._spec.max_tree - 1) * max(used, 1)
            kept += new
        self._finish_decode(kept)

    def _follow_spec(
        self,
        batch: ScheduledBatch,
        i: int,
        req: Req,
        token: int,
        out: ForwardOutput,
        plain: list[tuple[int, int, Any]],
    ) -> None:
        """Keep the drafter in step with plain passes: prefill chunks hand over their features,
        the last chunk starts the drafter, a plain decode step advances it (collected in
        ``plain``; the caller hands them over together)."""
        if req.finished:
            return
        offset = sum(batch.extend_lens[:i])
        n = batch.extend_lens[i]
        hidden = None if out.hidden_states is None else out.hidden_states[offset : offset + n]
        if not batch.prefill_row[i]:
            if not batch.discard[i]:
                plain.append((req.req_pool_idx, token, hidden))
            return
        if hidden is not None:
            self._spec.on_extend(req.req_pool_idx, batch.prefix_lens[i], hidden)
        if not batch.discard[i]:  # the last chunk: its sampled token is the first output
            self._spec.on_prefill_done(req.req_pool_idx, req.fill_ids, token)

    def _after_discarded_row(
        self, req: Req, lp: Any, *, is_chunk: bool, batch_prefix: int, batch_extend: int
    ) -> None:
        if req.finished:
            return
        if lp is not None:
            self.outputs.record_input_logprobs(req, lp)
        if is_chunk:
            self._share_prefix(req, batch_prefix + batch_extend)
            return
        # prefill-only request (max_new_tokens == 0)
        req.finish(FinishReason.length(0))
        self.outputs.add(req)
        self._release(req)

    def _share_prefix(self, req: Req, done: int) -> None:
        """Insert the request's computed tokens ``[0, done)`` into the tree while it keeps running
        (``done`` is what this step computed: with overlap, a later step may already have moved
        ``kv_len`` further)."""
        if done <= req.prefix_len:
            return
        self.cache.cache_unfinished(
            req.handle,
            req.fill_ids[:done],
            self.req_pool.req_to_token[req.req_pool_idx, :done],
            req_row=req.req_pool_idx,
        )

    def _append_tokens(self, req: Req, tokens: list[int]) -> None:
        """Several tokens from one speculative step or continuous decode batch (no logprobs: see
        eligibility). A grammar advances over them in order; the first token that terminates it
        ends the output."""
        if req.grammar is not None:
            for j, token in enumerate(tokens):
                self._grammar.accept(req, token)
                if req.finished:  # rejected: GrammarQueue.accept aborted the request
                    self.outputs.add(req)
                    return
                if req.grammar.is_terminated():
                    tokens = tokens[: j + 1]
                    break
        req.output_ids.extend(tokens)
        reason = req.stop_checker.check(req.output_ids, len(tokens))
        if reason is None and req.grammar is not None and req.grammar.is_terminated():
            reason = FinishReason.stop_matched(tokens[-1])
        if reason is not None:
            if reason.keep is not None:
                del req.output_ids[reason.keep :]  # tokens past a stop do not belong
            req.finish(reason)
        self.outputs.add(req)

    def _append_token(self, req: Req, token: int, lp: Any) -> None:
        req.output_ids.append(token)
        if lp is not None:
            self.outputs.record_logprobs(req, lp)
        if req.grammar is not None:
            self._grammar.accept(req, token)
        num_new = 1
        if self.cfg.enable_jump_forward and req.grammar is not None and not req.finished:
            num_new += self._jump_forward(req)
        reason = req.stop_checker.check(req.output_ids, num_new)
        if reason is None and req.grammar is not None and req.grammar.is_terminated():
            reason = FinishReason.stop_matched(token)
        if reason is not None:
            if reason.keep is not None:
                del req.output_ids[reason.keep :]  # tokens past a stop string do not belong
            req.finish(reason)
        self.outputs.add(req)

    # ------------------------------------------------------------------ jump-forward
    def _may_jump(self, batch: ScheduledBatch) -> bool:
        return self.cfg.enable_jump_forward and any(r.grammar is not None for r in batch.reqs)

    def _jump_forward(self, req: Req) -> int:
        """Append the text the grammar forces, retokenized at the boundary. Returns the number of
        tokens appended; the KV of the rewritten tail is fixed up in ``_apply_jumps``."""
        kept_kv = min(req.kv_len, len(req.fill_ids) - 1)  # the newest token has no KV yet
        first_mutable = max(req.sent_output_len, req.prefix_len - req.prompt_len, 0)
        drop_k, new_ids = self._grammar.jump_forward(req, first_mutable=first_mutable)
        budget = req.params.max_new_tokens - (len(req.output_ids) - drop_k)
        if new_ids and len(new_ids) > budget:
            req.grammar.rollback(len(new_ids) - max(budget, 0))
            new_ids = new_ids[: max(budget, 0)]
        if not new_ids and not drop_k:
            return 0
        if drop_k:
            del req.output_ids[len(req.output_ids) - drop_k :]
        req.output_ids.extend(new_ids)
        keep = min(kept_kv, len(req.fill_ids) - len(new_ids))
        self._jump_pending.append((req, keep))
        self.stats.jump_forward_tokens += len(new_ids)
        return len(new_ids)

    def _apply_jumps(self) -> None:
        """KV past the last unchanged token is dropped; the request re-enters through the next
        prefill pass, which computes its forced tokens in one extend."""
        pending, self._jump_pending = self._jump_pending, []
        for req, keep in pending:
            row = self.req_pool.req_to_token[req.req_pool_idx]
            if req.kv_len > keep:
                self.cache.free_slots(row[keep : req.kv_len].clone())
            req.kv_len = keep
            if req.finished:
                continue
            if req in self.running:
                self.running.remove(req)
            self.jumped.append(req)

    def _drop_finished_running(self) -> None:
        done = [r for r in self.running if r.finished]
        if not done:
            return
        self.running = [r for r in self.running if not r.finished]
        for req in done:
            self._finish_chunked_abort(req)

    def _release_deferred(self) -> None:
        """Called when the oldest in-flight step is complete: everything deferred while it was
        queued can go (later steps never include finished requests)."""
        pending, self.release_after_inflight = self.release_after_inflight, []
        for req in pending:
            self._release(req)

    def _release(self, req: Req) -> None:
        """Give back a request's row and KV: computed tokens go into the tree (or are freed)."""
        if req.req_pool_idx is None:
            return
        row = req.req_pool_idx
        if self.spec is not None:
            self._spec.release(row)
        # The newest KV slot may belong to a token that was computed but never processed (the
        # request finished while a step was in flight): its id is unknown, so it is freed, not cached.
        known = min(req.kv_len, len(req.fill_ids))
        slots = self.req_pool.req_to_token[row, : req.kv_len].clone()
        self.cache.cache_finished(req.handle, req.fill_ids[:known], slots, kv_len=known)
        self.req_pool.free(row)
        req.req_pool_idx = None
        req.handle = None
        req.match = None
        req.kv_len = 0

    def _finish_chunked_abort(self, req: Req) -> None:
        """A finished request leaves: its last output goes out and its row is released."""
        self.outputs.add(req)
        self._retire(req)

    def _retire(self, req: Req) -> None:
        """Release now, or once the step in flight (which may read the request's row) is done."""
        if self.inflight:
            self.release_after_inflight.append(req)
        else:
            self._release(req)

    # ================================================================== memory pressure
    def _sync_inflight(self) -> None:
        """Process every in-flight step so deferred frees happen (needed before retraction)."""
        while self.inflight:
            self._process_oldest()
        self._release_deferred()

    def _retract_until(self, need: int, protect: Req | None = None, per_request: int = 1) -> None:
        """Retract running requests until ``need`` slots are available. ``protect`` (a request
        mid-chunk) is never retracted; without it, ``need`` is one slot per decoding request, so
        it shrinks with every retraction."""
        self._sync_inflight()
        candidates = [r for r in retraction_order(self.running) if r is not protect]
        old = self.ratio.value
        retracted = 0
        while self.cache.available_size < need:
            if not candidates or (protect is None and len(self.running) == 1):
                for req in self.running if protect is None else [protect]:
                    req.finish(_too_big())
                self._drop_finished_running()
                self.outputs.flush()
                return
            req = candidates.pop(0)
            self.running.remove(req)
            self._release(req)
            req.num_retractions += 1
            self.waiting.insert(0, req)
            retracted += 1
            if protect is None:
                need = per_request * len(self.running)
        if retracted:
            self.stats.num_retracted += retracted
            self.ratio.raise_to(ratio_after_retraction(self.running))
            logger.warning(
                "KV cache pool is full. Retract requests. #retracted_reqs: %d, "
                "#new_token_ratio: %.4f -> %.4f",
                retracted,
                old,
                self.ratio.value,
            )

    def _preempt_for(self, req: Req, adder: PrefillAdder) -> bool:
        """Priority preemption: retract running requests whose priority is lower than ``req``'s
        by at least the threshold, lowest first, until the adder's budget could admit it.
        Returns True if any request was retracted."""
        if not self.cfg.enable_priority_scheduling:
            return False
        victims = sorted(
            (r for r in self.running if req.priority - r.priority >= self.cfg.priority_preemption_threshold),
            key=lambda r: r.priority,
        )
        if not victims:
            return False
        self._sync_inflight()
        need = len(req.fill_ids) - req.prefix_len + req.remaining_new_tokens
        preempted = 0
        for victim in victims:
            if adder.covers(need):
                break
            if victim not in self.running or victim.finished:
                continue
            charge = charged_future_tokens(victim, self.ratio.value)
            before = self.cache.available_size
            self.running.remove(victim)
            self._release(victim)
            victim.num_retractions += 1
            self.waiting.append(victim)
            adder.credit(charge + (self.cache.available_size - before))
            preempted += 1
        self.stats.num_retracted += preempted
        return preempted > 0

    def _abort_unfittable(self, req: Req, why: str) -> None:
        self.waiting.remove(req)
        req.finish(FinishReason.abort(why, status_code=400))
        self.outputs.add(req)
        self.outputs.flush()

    # ================================================================== stats and logs
    def reset_counters(self) -> None:
        """Forget what ran so far (after the start-up warm-up): counters, the forecast ratio, the
        speculative acceptance and the cache tiers' counters."""
        self.stats = SchedulerCounters()
        self.ratio = NewTokenRatio(self.cfg.schedule_conservativeness)
        self._decode_steps = 0
        self._tokens_since_log = 0
        self._last_log = time.monotonic()
        if self.spec is not None:
            self._spec.reset_counters()
        if self.grammar is not None:
            self.grammar.take_compile_times()
        self.cache.reset_counters()

    def live_stats(self) -> dict[str, float]:
        total = self.cache.total_size
        s = self.stats
        return {
            "num_running_reqs": len(self.running) + (1 if self.chunked else 0),
            "num_queue_reqs": len(self.waiting),
            "num_grammar_queue_reqs": len(self.grammar.pending) if self.grammar else 0,
            "token_usage": 1.0 - self.cache.available_size / total if total else 0.0,
            "cache_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "num_retracted_reqs": s.num_retracted,
            "gen_throughput": s.gen_throughput,
            "spec_accept_length": self._spec.mean_accept_length if self.spec is not None else 0.0,
            "prompt_tokens_total": s.prompt_tokens,
            "cached_tokens_total": s.cached_tokens,
            "max_total_num_tokens": total,
            "available_tokens": self.cache.available_size,
            "evictable_tokens": self.cache.evictable_size,
            "new_token_ratio": self.ratio.value,
            "jump_forward_tokens_total": s.jump_forward_tokens,
            "continuous_decode_steps_total": s.continuous_decode_steps,
            "prefill_batches_total": s.prefill_batches,
            "spec_window_steps_total": s.spec_window_steps,
            "decode_step_ms": (self.pace.per_step or 0.0) * 1e3,
            **self.cache.tier_stats(),
        }

    def _log_prefill(self, batch: ScheduledBatch) -> None:
        new_tokens = sum(batch.extend_lens)
        # tokens this pass did not compute: each prompt row's prefix when it was launched
        cached = sum(p for p, row in zip(batch.prefix_lens, batch.prefill_row) if row)
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            len(batch.reqs),
            new_tokens,
            cached,
            self.live_stats()["token_usage"],
            len(self.running),
            len(self.waiting),
        )

    def _log_decode(self, steps: int = 1) -> None:
        now = time.monotonic()
        dt = max(now - self._last_log, 1e-6)
        self.stats.gen_throughput = self._tokens_since_log / dt
        self._last_log, self._tokens_since_log = now, 0
        extra = f", accept len: {self._spec.mean_accept_length:.2f}" if self.spec is not None else ""
        if steps > 1:  # a continuous decode launch: one line for its steps
            extra += f", #steps: {steps}"
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
            "gen throughput (token/s): %.2f, #queue-req: %d%s",
            len(self.running),
            self.cache.total_size - self.cache.available_size,
            self.live_stats()["token_usage"],
            self.stats.gen_throughput,
            len(self.waiting),
            extra,
        )


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
    continuous_decode_steps: int = 0  # decode steps run inside continuous decode batches
    prefill_batches: int = 0  # prefill (extend) passes whose results were processed
    spec_window_steps: int = 0  # speculative steps run inside windows (several per host sync)


def _too_big() -> FinishReason:
    return FinishReason.abort("the request needs more KV cache than the pool holds", status_code=400)
