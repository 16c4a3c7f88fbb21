"""The grammar queue: constrained requests wait here until their grammar compiles (docs/design.md §6).

Compilation runs in the grammar manager's thread pool; the scheduler loop only polls futures, so
a slow or hostile grammar never stalls it. A failed or timed-out compile finishes that request
alone with an abort carrying the backend's message and the field at fault
(``sampling_params.regex``, ...; HTTP 400 at the edge, naming the client's field). The backend
itself is built on the first constrained request, which is the start-up warm-up's where it runs
(CUDA by default): importing and indexing a tokenizer costs seconds.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from phloem.runtime.sampling.params import PREFIX as SAMPLING_PREFIX
from phloem.runtime.sampling.stop import FinishReason
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
    ) -> None:
        self.backend_name = backend_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.compile_timeout = compile_timeout
        self.pending: list[Req] = []
        self._manager: Any = None
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

    def take_compile_times(self) -> list[float]:
        """Compile durations recorded since the last call (the list object stays: the manager
        holds its ``append``)."""
        times = self.compile_times[:]
        del self.compile_times[: len(times)]
        return times

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        from phloem.grammars.base import GrammarSpec

        kind, text = req.params.grammar
        try:
            req.grammar_future = self.manager.submit(GrammarSpec(kind, text))  # type: ignore[attr-defined]
        except Exception as e:  # backend construction failed: fail this request, keep serving
            req.grammar_future = _failed(e)  # type: ignore[attr-defined]
        self.pending.append(req)

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
            try:
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
        to ``req.output_ids``."""
        from phloem.grammars.jump_forward import jump_forward

        return jump_forward(req.grammar, self.tokenizer, req.output_ids[first_mutable:])

    def fill_mask(self, reqs: list[Req]) -> torch.Tensor | None:
        """Bitmask ``[B, ceil(V/32)]`` for a batch, or None when no row is constrained."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.finished]
        if not rows:
            return None
        from phloem.grammars.bitmask import allocate_bitmask

        mask = allocate_bitmask(len(reqs), self.vocab_size)  # all allowed
        for i in rows:
            reqs[i].grammar.fill_next_token_bitmask(mask, i)
        return mask


def _failed(e: Exception) -> Any:
    from concurrent.futures import Future

    fut: Future[Any] = Future()
    fut.set_exception(e)
    return fut
