"""The grammar queue: constrained requests wait here until their grammar compiles (docs/design.md §6).

Compilation runs in the grammar manager's thread pool; the scheduler loop only polls futures, so
a slow or hostile grammar never stalls it. A failed or timed-out compile finishes that request
alone with an abort carrying the backend's message and the field at fault
(``sampling_params.regex``, ...; HTTP 400 at the edge, naming the client's field). The backend
itself is built on the first constrained request, which is the start-up warm-up's where it runs
(CUDA by default): importing and indexing a tokenizer costs seconds.

Grammars on the device (``--grammar-on-device``, docs/design.md §6): a regex, or a JSON schema
whose language is regular (``grammars.regular.runs_on_device``), compiles into a token automaton
(outlines-core's DFA) whose masks and transitions live in the scheduler's ``AutomatonTable``. Such
a row masks and advances on the device, so it needs no host mask, joins continuous decode, and the
host only checks its tokens afterwards with a matcher over the same DFA. A spec that does not
compile that way (too large, a feature the conversion does not honour) takes the server's backend.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from phloem.grammars.automaton import UNBOUNDED  # light: numpy arrays, no grammar library
from phloem.runtime.sampling.params import PREFIX as SAMPLING_PREFIX
from phloem.runtime.sampling.stop import FinishReason
from phloem.runtime.scheduler.policy import needs_host_mask
from phloem.runtime.scheduler.req import Req

logger = logging.getLogger("phloem.scheduler")


class GrammarQueue:
    def __init__(
        self,
        *,
        backend_name: str,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: set[int],
        compile_timeout: float,
        automata: Any = None,
        canonical_forced_text: bool = False,
    ) -> None:
        self.backend_name = backend_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.compile_timeout = compile_timeout
        self.automata = automata  # AutomatonTable, or None: every grammar takes the host path
        # jump-forward is on: device masks spell forced text canonically (OutlinesBackend)
        self.canonical_forced_text = canonical_forced_text
        self.pending: list[Req] = []
        self._manager: Any = None
        self._device_manager: Any = None
        self.compile_times: list[float] = []  # appended by compile threads, drained by take_compile_times

    @property
    def manager(self) -> Any:
        if self._manager is None:
            from phloem.grammars.manager import GrammarManager
            from phloem.grammars.registry import create_backend

            t0 = time.perf_counter()
            backend = create_backend(
                self.backend_name,
                tokenizer=self.tokenizer.hf,
                vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids,
            )
            logger.info("grammar backend %s ready in %.2f s", self.backend_name, time.perf_counter() - t0)
            self._manager = GrammarManager(
                backend, compile_timeout=self.compile_timeout, on_compiled=self.compile_times.append
            )
        return self._manager

    @property
    def device_manager(self) -> Any:
        """The compile cache of device automata (outlines-core DFAs with their tables)."""
        if self._device_manager is None:
            from phloem.grammars.manager import GrammarManager
            from phloem.grammars.registry import create_backend

            backend = create_backend(
                "outlines",
                tokenizer=self.tokenizer.hf,
                vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids,
                build_automata=True,
                canonical_forced_text=self.canonical_forced_text,
            )
            self._device_manager = GrammarManager(
                backend, compile_timeout=self.compile_timeout, on_compiled=self.compile_times.append
            )
        return self._device_manager

    def take_compile_times(self) -> list[float]:
        """Compile durations recorded since the last call (the list object stays: the manager
        holds its ``append``)."""
        times = self.compile_times[:]
        del self.compile_times[: len(times)]
        return times

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        from phloem.grammars.base import GrammarSpec
        from phloem.grammars.regular import runs_on_device

        spec = GrammarSpec(*req.params.grammar)
        req.grammar_future = None
        if self.automata is not None and runs_on_device(spec):
            try:
                req.grammar_future = self.device_manager.submit(spec)
                req.grammar_on_device = True
            except Exception:  # the outlines backend cannot be built: the host path serves it
                logger.exception("device grammar backend failed; grammars take the host path")
                self.automata = None
        if req.grammar_future is None:
            self._submit_host(req, spec)
        self.pending.append(req)

    def _submit_host(self, req: Req, spec: Any) -> None:
        req.grammar_on_device = False
        try:
            req.grammar_future = self.manager.submit(spec)
        except Exception as e:  # backend construction failed: fail this request, keep serving
            req.grammar_future = _failed(e)

    def ready(self, scheduler: Any) -> list[Req]:
        """Requests whose grammar is compiled (matcher attached); failures are finished here."""
        out: list[Req] = []
        still: list[Req] = []
        for req in self.pending:
            fut = req.grammar_future  # type: ignore[attr-defined]
            if req.finished:
                continue
            if not fut.done():
                still.append(req)
                continue
            if req.grammar_on_device and fut.exception() is not None:
                from phloem.grammars.base import GrammarSpec

                self._submit_host(req, GrammarSpec(*req.params.grammar))  # the backend decides
                still.append(req)
                continue
            try:
                if req.grammar_on_device:
                    req.grammar = self.device_manager.new_matcher(fut.result())
                    assert self.automata is not None
                    req.automaton = self.automata.acquire(req.grammar.automaton)  # None: table full
                else:
                    req.grammar = self.manager.new_matcher(fut.result())
                out.append(req)
            except Exception as e:
                kind, _ = req.params.grammar  # the queue holds constrained requests only
                field = f"{SAMPLING_PREFIX}.{kind}"
                req.finish(FinishReason.abort(f"invalid grammar: {e}", status_code=400, param=field))
                scheduler.outputs.add(req)
        self.pending = still
        scheduler.outputs.flush()
        return out

    # ------------------------------------------------------------------ per step
    def accept(self, req: Req, token: int) -> None:
        if not req.grammar.accept_token(token):
            # The mask allows only grammatical tokens, so this means EOS after termination or
            # a bug; end the request rather than emit text the grammar rejects.
            req.finish(FinishReason.abort("the grammar rejected a sampled token", status_code=500))

    def jump_forward(self, req: Req, *, first_mutable: int) -> tuple[int, list[int]]:
        """Text the grammar forces next, retokenized together with the output tokens from
        ``first_mutable`` on (earlier ones are final: sent to the client, or shared with the
        radix tree). Advances the matcher; returns ``(drop_k, new_ids)`` for the caller to apply
        to ``req.output_ids``. Forced runs shorter than ``MIN_JUMP_TOKENS`` are decoded instead,
        and the jump never takes the output past ``max_new_tokens``."""
        from phloem.grammars.jump_forward import MIN_JUMP_TOKENS, jump_forward

        return jump_forward(
            req.grammar,
            self.tokenizer,
            req.output_ids[first_mutable:],
            min_tokens=MIN_JUMP_TOKENS,
            max_tokens=req.params.max_new_tokens - len(req.output_ids),
        )

    def automaton_rows(self, reqs: list[Req], discard: list[bool]) -> tuple[Any, Any, Any] | None:
        """``(AutomatonLaunch, rows, init)`` of a launch, or None when no row masks on the device.
        A row starts from the state its matcher is in when the host has seen all its tokens,
        from the device's state when a step of it is still in flight, and free when it is
        unconstrained or its token is thrown away (a prefill chunk)."""
        if self.automata is None or not self.automata.in_use or all(r.automaton is None for r in reqs):
            return None
        from phloem.grammars.automaton import FREE, AutomatonLaunch

        init = []
        for req, dropped in zip(reqs, discard):
            if req.automaton is None or dropped:
                init.append(FREE)
            elif req.pending_outputs:
                init.append(-1)
            else:
                init.append(req.automaton.global_state(req.grammar.automaton_state()))
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        launch = AutomatonLaunch(self.automata, has_init=any(v != -1 for v in init))
        return launch, rows, torch.tensor(init, dtype=torch.int64)

    def tokens_to_end(self, req: Req) -> int | None:
        """The fewest tokens the request generates after those the host has seen, its stop token
        included, under a grammar on the device (``TokenAutomaton.steps_to_stop``); None when
        that is not known (no grammar, one on the host path, or no way to the end)."""
        return _from_host_state(req, "steps_to_stop")

    def tokens_left_at_most(self, req: Req) -> int | None:
        """The most tokens the request generates after those the host has seen, its stop token
        included, under a grammar on the device (``TokenAutomaton.longest_to_stop``); None when
        unbounded (a loop ahead) or not known."""
        return _from_host_state(req, "longest_to_stop")

    def shortest_output(self, req: Req) -> int | None:
        """The fewest tokens the request's grammar accepts, its stop token included, under a grammar
        on the device; None when not known."""
        if req.automaton is None:
            return None
        auto = req.automaton.automaton
        return int(auto.steps_to_stop[auto.initial])

    def fill_mask(self, reqs: list[Req]) -> torch.Tensor | None:
        """Bitmask ``[B, ceil(V/32)]`` for a batch, or None when no row needs a host mask."""
        rows = [i for i, r in enumerate(reqs) if needs_host_mask(r) and not r.finished]
        if not rows:
            return None
        from phloem.grammars.bitmask import allocate_bitmask

        mask = allocate_bitmask(len(reqs), self.vocab_size)  # all allowed
        for i in rows:
            reqs[i].grammar.fill_next_token_bitmask(mask, i)
        return mask


def _from_host_state(req: Req, bounds: str) -> int | None:
    """One of the request's automaton bounds per state (a ``TokenAutomaton`` array named
    ``bounds``) at the state the host has seen: 0 once the grammar ended, None without a grammar
    on the device or where the bound is the sentinel (``UNBOUNDED``, which is ``UNREACHABLE``)."""
    if req.automaton is None or req.grammar is None:
        return None
    state = req.grammar.automaton_state()
    if state < 0:
        return 0
    value = int(getattr(req.automaton.automaton, bounds)[state])
    return None if value == UNBOUNDED else value


def _failed(e: Exception) -> Any:
    from concurrent.futures import Future

    fut: Future[Any] = Future()
    fut.set_exception(e)
    return fut
