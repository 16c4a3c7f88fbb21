"""The scheduler loop (docs/design.md §4): receive, schedule, run, process.

CPU bookkeeping only. The loop reads aloud::

    while running:
        receive()                      # new requests, aborts, control messages
        batch = schedule()             # the first step kind with work: prefill if the adder
                                       # admits anything, else a speculative window or step,
                                       # continuous decode, or plain decode
        launch(batch)                  # batch.kind hands it to the worker (inline or on a thread)
        process(previous results)      # overlap: the results of the step before this one,
                                       # committed by the kind that built that batch

Without overlap, ``process`` handles the step just launched. With overlap, step N+1 is launched
before step N's tokens are looked at; N+1's inputs refer to N's tokens through future ids, and
requests finished at N free their memory only once N+1 is done (it still reads their rows).

The step kinds live in :mod:`phloem.runtime.scheduler.steps`; the scheduler keeps the queues
(waiting, running, chunked, jumped, in flight), releasing and retracting requests, appending
tokens, and the finish/flush/log tail every kind's ``process`` ends with.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from phloem.runtime.forward_io import ForwardMode, ForwardOutput
from phloem.runtime.messages import PAUSE_MODES
from phloem.runtime.sampling.stop import FinishReason
from phloem.runtime.scheduler.batch import ScheduledBatch
from phloem.runtime.scheduler.output import OutputCollector
from phloem.runtime.scheduler.policy import (
    DecodePace,
    NewTokenRatio,
    decodes_ahead,
    needs_host_mask,
    ratio_after_retraction,
    retraction_order,
)
from phloem.runtime.scheduler.prefill_adder import PrefillAdder, charged_future_tokens
from phloem.runtime.scheduler.protocols import Cache, Grammar, ReqPool, Sampling, Speculative, Worker
from phloem.runtime.scheduler.req import Req, next_stop_tag
from phloem.runtime.scheduler.stats import SchedulerCounters, StepLog, StepTimes
from phloem.runtime.scheduler.steps import StepKind
from phloem.runtime.scheduler.steps.chain import ChainDecodeStep
from phloem.runtime.scheduler.steps.continuous import ContinuousDecodeStep
from phloem.runtime.scheduler.steps.decode import DecodeStep
from phloem.runtime.scheduler.steps.lead import JumpLeadStep
from phloem.runtime.scheduler.steps.prefill import PrefillStep
from phloem.runtime.scheduler.steps.spec_step import SpecStep
from phloem.runtime.scheduler.steps.spec_window import SpecWindowStep

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerCounters", "StepTimes"]

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
    # With overlap: keep a batch that may jump in flight too (a jump then throws its request's
    # next launch away, ``Scheduler._jump_forward``), rather than process it at once.
    jump_overlap: bool = False
    # With overlap: keep an extend pass in flight even when its rows may jump (the decode launch
    # behind it starts from its sampled tokens on the device); a row jumps only once the host has
    # seen all its tokens, so a jump never throws a launch away.
    jump_extend_overlap: bool = False
    # Extend a jump's forced tokens in the first pass of the next continuous decode launch
    # (``steps.lead``) when that pass has at most ``jump_lead_rows`` rows of at most
    # ``jump_lead_tokens`` new tokens each (the short extend graphs' shape); 0: never.
    jump_lead_rows: int = 0
    jump_lead_tokens: int = 0
    # Chain decode launches (``steps.chain``, ``PHLOEM_JUMP_CHAIN``): batches of at most
    # ``jump_chain_rows`` rows whose every step takes up to ``jump_chain_width - 1`` forced tokens
    # a row on the device; 0: never.
    jump_chain_width: int = 0
    jump_chain_rows: int = 0
    # Decode steps launched as one (``--num-continuous-decode-steps``): see ``steps.continuous``.
    decode_steps: int = 1
    # Device time such a launch may take, in seconds (0: always ``decode_steps``): see
    # ``policy.continuous_decode_plan``.
    decode_budget_s: float = 0.0
    # Continuous decode launches carry each row's stop ids for the decode graphs' early exit
    # (executor/decode_exit.py): on when the worker's graphs have it.
    decode_early_exit: bool = False
    # Without it: process at once a decode batch whose every row may end within its tokens in
    # flight (``_may_all_end``); off only to measure what that saves.
    sync_near_end: bool = True
    # Launch no step past a request's ``output_cap`` (the most tokens its grammar on the device
    # still allows, ``_output_cap``); off only to measure what that saves.
    cap_at_grammar_end: bool = True


NEAR_END_SYNCS = 3  # decode batches a request may have processed at once near its end
NEAR_END_MIN_OUTPUT = 24  # shortest grammar output (tokens) for which that is worth a wait


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
        self.prefilling: dict[int, tuple[Req, int]] = {}
        self.ratio = NewTokenRatio(config.schedule_conservativeness)
        self.inflight: deque[tuple[ScheduledBatch, Future[ForwardOutput]]] = deque()
        self.release_after_inflight: list[Req] = []
        self.stats = SchedulerCounters()
        self.log = StepLog(self)
        self.pace = DecodePace()
        self.last_step = StepTimes("", 0, 0.0, 0.0, 0.0)
        self.record_step_times = False  # fill last_step each step (the loop trace turns it on)
        # What the loop is in the middle of, as (verb, batch mode): the watchdog names it when a
        # step never returns (``heartbeat.LoopWatch``). Kept as a tuple: no formatting per step.
        self.doing: tuple[str, str] = ("", "")
        # pause_generation: no step is launched; requests that arrive wait in the queues
        self.paused = False
        # Device memory given back (release_memory_occupation: "kv_cache", "weights"): no step
        # can run until it is taken back.
        self.released: set[str] = set()
        self.prefill_step = PrefillStep(self)
        self.decode_step = DecodeStep(self)
        self.chain_step: ChainDecodeStep | None = None
        self.kinds = self._step_kinds()

    def _step_kinds(self) -> list[StepKind]:
        """The kinds ``schedule`` asks, in order; the first with a batch runs. A speculative kind
        declines unless every running request may decode speculatively; then plain decode runs."""
        kinds: list[StepKind] = [self.prefill_step]
        if self.spec is None and self.cfg.decode_steps > 1 and self.cfg.jump_lead_rows > 0:
            kinds.insert(0, JumpLeadStep(self))  # before the prefill step takes the jumped rows
        if self.spec is not None:
            kinds += [SpecWindowStep(self, self.spec), SpecStep(self, self.spec)]
        self.chain_step = None
        if self.spec is None and self.cfg.jump_chain_rows > 0:
            self.chain_step = ChainDecodeStep(self)
            kinds.append(self.chain_step)  # before plain decoding takes the same rows
        if self.spec is None and self.cfg.decode_steps > 1:
            kinds.append(ContinuousDecodeStep(self))
        kinds.append(self.decode_step)
        return kinds

    # ================================================================== entry points
    def add_request(self, req: Req) -> None:
        if self.grammar is not None and req.params.grammar is not None:
            self.grammar.add(req)  # waits there until its grammar compiles
            return
        self.waiting.append(req)

    def abort(
        self,
        rid: str | None,
        *,
        abort_all: bool = False,
        message: str = "aborted",
        status_code: int | None = None,
    ) -> None:
        reason = FinishReason.abort(message, status_code=status_code)
        for q in (self.waiting, self.grammar.pending if self.grammar else []):
            for req in [r for r in q if abort_all or r.rid == rid]:
                q.remove(req)
                req.finish(reason)
                self.release(req)
                self.outputs.add(req)
        for req in [*self.running, *self.jumped, *([self.chunked] if self.chunked else [])]:
            if abort_all or req.rid == rid:
                req.finish(reason)  # leaves the batch when its in-flight step is processed
        if not self.inflight:  # nothing reads their rows: they leave now, and their answer with them
            self._drop_finished_running()
            self._drop_finished_parked()
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

    # ================================================================== pause (RL trainers)
    @property
    def stopped(self) -> bool:
        """Whether steps are held back: generation paused or device memory released."""
        return self.paused or bool(self.released)

    @property
    def holds_kv(self) -> bool:
        """Whether a request holds KV or a step is in flight (waiting requests hold nothing)."""
        return bool(self.running or self.chunked or self.jumped or self.inflight)

    def pause(self, mode: str) -> None:
        """Stop launching steps (``pause_generation``); the steps in flight are processed first.
        ``abort``: every request ends now, aborted as by its caller; ``retract``: running requests
        go back to the front of the waiting queue with their KV given back (what they computed
        stays in the prefix tree) and are recomputed after :meth:`resume`, their output kept;
        ``in_place``: they keep their KV and go on where they stopped."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}")
        self.sync_inflight()
        self.paused = True
        if mode == "abort":
            self.abort(None, abort_all=True, message="aborted: generation was paused")
        elif mode == "retract":
            self._retract_all()

    def resume(self) -> None:
        """Launch steps again (``continue_generation``)."""
        self.paused = False

    def _retract_all(self) -> None:
        reqs = [*self.running, *self.jumped, *([self.chunked] if self.chunked else [])]
        self.running, self.jumped, self.chunked = [], [], None
        for req in reqs:
            self.release(req)
            req.is_chunked = False
            req.num_retractions += 1
        self.waiting[:0] = reqs
        self.stats.num_retracted += len(reqs)

    def _drop_finished_parked(self) -> None:
        """Finished requests outside ``running`` (a cut prompt, a jumped request) leave now."""
        if self.chunked is not None and self.chunked.finished:
            req, self.chunked = self.chunked, None
            self.finish_dropped(req)
        for req in [r for r in self.jumped if r.finished]:
            self.jumped.remove(req)
            self.finish_dropped(req)

    def flush_unheld(self) -> bool:
        """Empty the prefix cache unless a request holds KV (waiting requests may remain: they
        hold none, and look their prefix up again when admitted)."""
        if self.holds_kv:
            return False
        return bool(self.cache.flush())

    # ================================================================== the loop
    def step(self) -> bool:
        """One iteration after messages were received. Returns False when there was nothing to do."""
        if self.stopped:
            return False  # paused or memory released: nothing is in flight (see pause)
        self.doing = ("schedule", "")
        if self.grammar is not None:
            self.waiting.extend(self.grammar.ready(self))
        t0 = time.perf_counter()
        batch = self.schedule()
        late_mask: Future[Any] | None = None
        t1 = time.perf_counter()
        if batch is not None:
            self.doing = ("launch", batch.mode.name)
            mask, late_mask = self._grammar_mask(batch)
            self.inflight.append((batch, self.launch(batch, mask)))
        t2 = time.perf_counter()
        # Without overlap: process what was just launched. With overlap: keep one step in flight,
        # except for a step whose requests may jump forward unless ``jump_overlap`` (a request
        # that jumps while its next launch is in flight throws that launch away: _jump_forward)
        # or, for an extend pass, ``jump_extend_overlap`` (its rows then wait to jump).
        overlap = (
            self.cfg.overlap
            and batch is not None
            and (
                self.cfg.jump_overlap
                or (self.cfg.jump_extend_overlap and batch.is_prefill)
                or not self._may_jump(batch)
            )
            and not self._may_all_end(batch)
        )
        keep = 1 if overlap else 0
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
            assert batch is not None and self.grammar is not None
            late_mask.set_result(self.grammar.fill_mask(batch.reqs))
        if batch is None and not self.inflight:
            self.release_deferred()
            return False
        return True

    def drain(self) -> None:
        while self.inflight:
            self._process_oldest()
        self.release_deferred()

    def schedule(self) -> ScheduledBatch | None:
        """The batch of the first step kind that has one. While a chain launch is in flight only
        another may follow it (``steps.chain``: other kinds read positions it has not told yet),
        and only when nothing waits for admission; else it is processed first."""
        if self.chain_step is not None and any(b.kind is self.chain_step for b, _ in self.inflight):
            if not (self.waiting or self.jumped or self.chunked is not None):
                batch = self.chain_step.schedule()
                if batch is not None:
                    return batch
            self.sync_inflight()
        for kind in self.kinds:
            batch = kind.schedule()
            if batch is not None:
                return batch
        return None

    def _grammar_mask(self, batch: ScheduledBatch) -> tuple[Any, Future[Any] | None]:
        """The batch's grammar bitmask now, or a future filled after the in-flight step is
        processed (when a constrained row's previous token is still in flight)."""
        if self.grammar is None or not any(map(needs_host_mask, batch.reqs)):
            return None, None
        if any(needs_host_mask(r) and r.pending_outputs for r in batch.reqs):
            fut: Future[Any] = Future()
            return fut, fut
        return self.grammar.fill_mask(batch.reqs), None

    def launch(self, batch: ScheduledBatch, vocab_mask: Any = None) -> Future[Any]:
        assert batch.kind is not None, "a batch is built by its step kind"
        return batch.kind.launch(batch, vocab_mask)

    def _process_oldest(self) -> None:
        batch, fut = self.inflight.popleft()
        assert batch.kind is not None
        self.doing = ("process", batch.mode.name)
        batch.kind.process(batch, fut)

    # ================================================================== shared by the step kinds
    def count_decode_launch(self, steps: int) -> None:
        """A decode batch of ``steps`` steps was scheduled: the forecast ratio decays per step."""
        for _ in range(steps):
            self.ratio.step()
        self.log.decode_launches += 1

    def unseen_steps(self, reqs: list[Req], steps: int, *, jumped_ok: bool = False) -> int:
        """How many steps the decoding rows ``reqs`` may take before the host sees their tokens
        (continuous decode, speculative windows), at most ``steps``; 0 when they may not: something
        waits to be admitted (it would wait the whole batch), a row needs the host between its
        tokens (``decodes_ahead``) or a grammar is still compiling. Never past any row's
        ``max_new_tokens``, nor past the step by which every row has certainly ended
        (``Req.steps_left_at_most``). ``jumped_ok``: rows that jumped forward are among ``reqs``
        (a jump's lead launch, ``steps.lead``) rather than waiting for a prefill pass."""
        if not reqs or self.waiting or self.chunked is not None or (self.jumped and not jumped_ok):
            return 0
        if self.grammar is not None and self.grammar.pending:
            return 0
        last = 0  # steps by which every row has certainly ended
        for req in reqs:
            if not decodes_ahead(req):
                return 0
            steps = min(steps, req.remaining_new_tokens)
            last = max(last, req.steps_left_at_most)
        # A grammar's bound ends the launch only where it ends the whole batch: cutting every
        # row's launch for one row near its end would split a large batch into short launches.
        return min(steps, last)

    def prompts_in_flight(self) -> list[Req]:
        """Requests whose prompt KV is still being computed, before this round's admissions: a
        prefill pass launched and not processed. Their prompt enters the tree once the last such
        pass is processed."""
        return [req for req, _ in self.prefilling.values()]

    def finish_decode(self, new_tokens: int, *, steps: int = 1) -> None:
        """The tail of processing a decode-kind step: finished requests leave, outputs go out,
        and every ``log_interval`` launches a log line (``steps``: steps of this launch)."""
        self._finish_step()
        self.log.decode_processed(new_tokens, steps)

    def finish_prefill(self, batch: ScheduledBatch) -> None:
        """The tail of processing a prefill pass (finished requests leave, outputs go out, a log line)."""
        self._finish_step()
        self.stats.prefill_batches += 1
        self.log.prefill(batch)

    def _finish_step(self) -> None:
        self._apply_jumps()
        self._drop_finished_running()
        self.outputs.flush()

    def share_prefix(self, req: Req, done: int) -> None:
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

    def append_tokens(self, req: Req, tokens: list[int], *, jump: bool = True) -> None:
        """Several tokens from one speculative step or continuous decode batch (no logprobs: see
        eligibility). A grammar advances over them in order; the first token that terminates it
        ends the output. ``jump``: jump forward after them where the grammar forces text (a chain
        launch, which takes forced tokens itself, does not)."""
        if req.grammar is not None:
            assert self.grammar is not None
            for j, token in enumerate(tokens):
                self.grammar.accept(req, token)
                if req.finished:  # rejected: GrammarQueue.accept aborted the request
                    self.outputs.add(req)
                    return
                if req.grammar.is_terminated():
                    tokens = tokens[: j + 1]
                    break
        req.output_ids.extend(tokens)
        num_new = len(tokens)
        jumps = jump and self.cfg.enable_jump_forward
        if jumps and req.grammar is not None and not req.grammar.is_terminated():
            num_new += self._jump_forward(req)  # the launch ended inside a forced run
        self._check_stop(req, num_new, tokens[-1])

    def append_token(self, req: Req, token: int, lp: Any) -> None:
        req.output_ids.append(token)
        if lp is not None:
            self.outputs.record_logprobs(req, lp)
        num_new = 1
        if req.grammar is not None:
            assert self.grammar is not None
            self.grammar.accept(req, token)
            if self.cfg.enable_jump_forward and not req.finished:
                num_new += self._jump_forward(req)
        self._check_stop(req, num_new, token)

    def _check_stop(self, req: Req, num_new: int, last: int) -> None:
        """Finish the request if its ``num_new`` newest tokens hit a stop (tokens past a stop
        string do not belong) or ended its grammar; either way it has output to send."""
        reason = req.stop_checker.check(req.output_ids, num_new)
        if reason is None and req.grammar is not None and req.grammar.is_terminated():
            reason = FinishReason.stop_matched(last)
        if reason is not None:
            if reason.keep is not None:
                del req.output_ids[reason.keep :]
            req.finish(reason)
        else:
            req.output_cap = self._output_cap(req)
        self.outputs.add(req)

    # ------------------------------------------------------------------ the end of a request
    def _output_cap(self, req: Req) -> int | None:
        """The most output tokens ``req`` can end with, from the state the host has seen of its
        grammar on the device (``Grammar.tokens_left_at_most``); None when unbounded or unknown.
        A stop token the grammar allows ends the request unless a ``min_new_tokens`` floor holds
        it back, so then there is no bound. Never below the outputs plus one while the request
        runs (a live state allows at least its stop token), so a request always has a next step.
        With it the scheduler stops launching steps for a row that has certainly ended, as at
        ``max_new_tokens``: a record that ends inside a launch gets no launch queued behind it."""
        if not self.cfg.cap_at_grammar_end or self.grammar is None or req.grammar is None:
            return None
        if req.params.min_new_tokens:
            return None
        left = self.grammar.tokens_left_at_most(req)
        return None if left is None else len(req.output_ids) + max(left, 1)

    def _may_all_end(self, batch: ScheduledBatch) -> bool:
        """Whether every row of a decode batch may end within its tokens in flight, as far as
        its grammar tells (``Grammar.tokens_to_end``, a lower bound). The batch is then processed
        at once instead of staying in flight: a launch queued behind it would compute a whole
        launch of steps for rows that have ended, while the wait costs the device only the
        host's work between two launches. That trade pays near the end of a document (a JSON
        record), not under a grammar that may end after almost any token (a regex of words up
        to a period), which would wait at every launch: so only grammars whose shortest output
        is ``NEAR_END_MIN_OUTPUT`` tokens or more take part, each request at most
        ``NEAR_END_SYNCS`` times. Without early exit only: with it the device skips those steps
        (docs/performance-notes.md has the measurements)."""
        if (
            self.cfg.decode_early_exit
            or not self.cfg.sync_near_end
            or self.grammar is None
            or batch.mode != ForwardMode.DECODE
        ):
            return False
        for req in batch.reqs:
            if req.near_end_syncs >= NEAR_END_SYNCS:
                return False
            shortest = self.grammar.shortest_output(req)
            if shortest is None or shortest < NEAR_END_MIN_OUTPUT:
                return False
            need = self.grammar.tokens_to_end(req)
            if need is None or need > req.pending_outputs:
                return False
        for req in batch.reqs:
            req.near_end_syncs += 1
        self.stats.near_end_syncs += 1
        return True

    # ------------------------------------------------------------------ jump-forward
    def _may_jump(self, batch: ScheduledBatch) -> bool:
        if self.chain_step is not None and batch.kind is self.chain_step:
            return False  # its rows take their forced tokens on the device
        return self.cfg.enable_jump_forward and any(r.grammar is not None for r in batch.reqs)

    def _jump_forward(self, req: Req) -> int:
        """Append the text the grammar forces, retokenized at the boundary. Returns the number of
        tokens appended; the KV of the rewritten tail is fixed up in ``_apply_jumps``.

        With overlap, a later launch of the request may already be in flight: it continues the
        text from before the jump, so its tokens are stale (``Req.stale_outputs``, thrown away when
        processed), and the request extends its forced tokens only once that launch is processed:
        until then the launch reads the request's row of ``req_to_token``, which the extend
        rewrites, and its device grammar state, which the extend sets from the matcher."""
        assert self.grammar is not None
        if self.cfg.jump_chain_rows and req.automaton is not None:
            return 0  # a row on the device takes its forced tokens in chain launches (steps.chain)
        if req.pending_outputs and not self.cfg.jump_overlap:
            return 0  # a launch of it is in flight (jump_extend_overlap): it decodes the forced run
        kept_kv = min(req.kv_len, len(req.fill_ids) - 1)  # the newest token has no KV yet
        first_mutable = max(req.sent_output_len, req.prefix_len - req.prompt_len, 0)
        drop_k, new_ids = self.grammar.jump_forward(req, first_mutable=first_mutable)  # within budget
        if not new_ids:
            return 0
        if drop_k:
            del req.output_ids[len(req.output_ids) - drop_k :]
        req.output_ids.extend(new_ids)
        req.stale_outputs = req.pending_outputs  # this step's own tokens are counted off already
        req.stop_tag = next_stop_tag()  # a stop a stale launch samples must not end what follows
        self.stats.jump_stale_tokens += req.pending_outputs
        keep = min(kept_kv, len(req.fill_ids) - len(new_ids))
        self._jump_pending.append((req, keep))
        self.stats.jump_forward_tokens += len(new_ids)
        return len(new_ids)

    def _apply_jumps(self) -> None:
        """KV past the last unchanged token is dropped; the request re-enters through the next
        prefill pass, which computes its forced tokens in one extend. Its slots are freed at once
        even when a stale launch still writes some of them: a launch that reuses them is submitted
        later, and steps run in submission order."""
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

    # ================================================================== release
    def _drop_finished_running(self) -> None:
        done = [r for r in self.running if r.finished]
        if not done:
            return
        self.running = [r for r in self.running if not r.finished]
        for req in done:
            self.finish_dropped(req)

    def release_deferred(self) -> None:
        """Called when the oldest in-flight step is complete: everything deferred while it was
        queued can go (later steps never include finished requests)."""
        pending, self.release_after_inflight = self.release_after_inflight, []
        for req in pending:
            self.release(req)

    def release(self, req: Req) -> None:
        """Give back a request's row and KV: computed tokens go into the tree (or are freed)."""
        if req.req_pool_idx is None:
            return
        row = req.req_pool_idx
        if self.spec is not None:
            self.spec.release(row)
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

    def finish_dropped(self, req: Req) -> None:
        """A finished request leaves: its last output goes out, and its row and KV are released
        now, or once the step in flight (which may read the row) is done."""
        self.outputs.add(req)
        if self.inflight:
            self.release_after_inflight.append(req)
        else:
            self.release(req)

    # ================================================================== memory pressure
    def sync_inflight(self) -> None:
        """Process every in-flight step so deferred frees happen (needed before retraction)."""
        while self.inflight:
            self._process_oldest()
        self.release_deferred()

    def retract_until(self, need: int, protect: Req | None = None, per_request: int = 1) -> None:
        """Retract running requests until ``need`` slots are available. ``protect`` (a request
        mid-chunk) is never retracted; without it, ``need`` is one slot per decoding request, so
        it shrinks with every retraction."""
        self.sync_inflight()
        candidates = [r for r in retraction_order(self.running) if r is not protect]
        old = self.ratio.value
        retracted = 0
        while self.cache.available_size < need:
            if not candidates or (protect is None and len(self.running) == 1):
                for req in self.running if protect is None else [protect]:
                    req.finish(self.too_big())
                self._drop_finished_running()
                self.outputs.flush()
                return
            req = candidates.pop(0)
            self.running.remove(req)
            self.release(req)
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

    def preempt_for(self, req: Req, adder: PrefillAdder) -> bool:
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
        self.sync_inflight()
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
            self.release(victim)
            victim.num_retractions += 1
            self.waiting.append(victim)
            adder.credit(charge + (self.cache.available_size - before))
            preempted += 1
        self.stats.num_retracted += preempted
        return preempted > 0

    def abort_unfittable(self, req: Req, why: str) -> None:
        self.waiting.remove(req)
        req.finish(FinishReason.abort(why, status_code=400))
        self.outputs.add(req)
        self.outputs.flush()

    @staticmethod
    def too_big() -> FinishReason:
        return FinishReason.abort("the request needs more KV cache than the pool holds", status_code=400)

    # ================================================================== stats
    def reset_counters(self) -> None:
        """Forget what ran so far (after the start-up warm-up): counters, the forecast ratio, the
        speculative acceptance and the cache tiers' counters."""
        self.stats = SchedulerCounters()
        self.ratio = NewTokenRatio(self.cfg.schedule_conservativeness)
        self.log = StepLog(self)
        if self.spec is not None:
            self.spec.reset_counters()
        if self.grammar is not None:
            self.grammar.take_compile_times()
        self.cache.reset_counters()

    def decode_steps_skipped(self) -> int:
        """Continuous decode steps the decode graphs skipped after every row's stop (early exit,
        ``executor/decode_exit.py``), as of a recent launch (exact once the launches in flight
        are processed); 0 without it or out of process."""
        graphs = getattr(getattr(self.worker, "runner", None), "cuda_graphs", None)
        exit = getattr(graphs, "exit", None)
        return exit.skipped_published if exit is not None else 0

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
            "spec_accept_length": self.spec.mean_accept_length if self.spec is not None else 0.0,
            "prompt_tokens_total": s.prompt_tokens,
            "cached_tokens_total": s.cached_tokens,
            "max_total_num_tokens": total,
            "available_tokens": self.cache.available_size,
            "evictable_tokens": self.cache.evictable_size,
            "new_token_ratio": self.ratio.value,
            "jump_forward_tokens_total": s.jump_forward_tokens,
            "jump_forward_stale_tokens_total": s.jump_stale_tokens,
            "jump_lead_launches_total": s.jump_lead_launches,
            "chain_launches_total": s.chain_launches,
            "chain_forced_tokens_total": s.chain_forced_tokens,
            "continuous_decode_steps_total": s.continuous_decode_steps,
            "decode_steps_skipped_total": self.decode_steps_skipped(),
            "near_end_syncs_total": s.near_end_syncs,
            "prefill_batches_total": s.prefill_batches,
            "spec_window_steps_total": s.spec_window_steps,
            "decode_step_ms": (self.pace.per_step or 0.0) * 1e3,
            "generation_paused": float(self.paused),
            "kv_cache_released": float("kv_cache" in self.released),
            "weights_released": float("weights" in self.released),
            **self.cache.tier_stats(),
        }
