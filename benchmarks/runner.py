"""Runs a workload's sessions against a backend: arrivals, concurrency limit, turn order, progress.

Sessions arrive all at once (``request_rate`` = inf) or as a Poisson process (exponential gaps with
mean ``1 / request_rate``, seeded). ``max_concurrency`` caps requests in flight. Turns of one session
run in order, each prompt holding the replies to the turns before it; after a failed turn the rest of
that session is recorded as failed without being sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from phloem.bench.client import Backend, Prepared, Result
from phloem.bench.datasets import History, Session, TokenizerLike, Turn


class ChatTokenizer(TokenizerLike, Protocol):
    """A tokenizer that can also render chat messages."""

    def apply_chat_template(self, messages: list[dict[str, str]], **kw: Any) -> str: ...


@dataclass(frozen=True)
class RunOptions:
    max_concurrency: int | None = None
    request_rate: float = float("inf")
    seed: int = 0
    ignore_eos: bool = True
    progress: bool = True


def prepare(
    session: Session, index: int, history: History, tokenizer: ChatTokenizer, ignore_eos: bool
) -> Prepared:
    """The request for turn ``index``: raw text, or the chat history rendered with the template."""
    turn: Turn = session.turns[index]
    messages = history.with_user(turn.content) if session.chat else None
    text = tokenizer.apply_chat_template(messages) if messages is not None else turn.content
    return Prepared(
        sid=session.sid,
        turn=index,
        text=text,
        output_len=turn.output_len,
        prompt_len=len(tokenizer.encode(text)),
        messages=messages,
        json_schema=turn.json_schema,
        regex=turn.regex,
        # The workloads' grammars cannot complete within a turn's output length, so EOS is masked
        # out anyway; ignore_eos keeps the server's admission estimate the same as unconstrained.
        ignore_eos=ignore_eos,
    )


def arrival_delays(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each session arrives (all 0 when the rate is infinite)."""
    if rate == float("inf") or rate <= 0:
        return [0.0] * count
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


class Progress:
    """tqdm when installed and wanted, else a plain line every tenth of the work."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.bar = total, 0, None
        self.enabled = enabled
        if enabled:
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="requests", file=sys.stderr)

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled and (self.done == self.total or self.done % max(1, self.total // 10) == 0):
            print(f"  {self.done}/{self.total} requests", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def run_sessions(
    backend: Backend, sessions: list[Session], tokenizer: ChatTokenizer, opt: RunOptions
) -> tuple[list[Result], float]:
    """Every turn's result (in completion order) and the wall time in seconds.

    The client's own tokenizer work stays outside the timed window: every session's first turn is
    rendered and counted before the clock starts, and outputs are retokenized after it stops. Left
    inside, it delayed the first send by the time it takes to tokenize every prompt (~0.3 s for
    256 prompts of ~540 tokens), since all sessions prepare before any of them sends.
    """
    sem = asyncio.Semaphore(opt.max_concurrency) if opt.max_concurrency else None
    results: list[Result] = []
    progress = Progress(sum(s.num_requests for s in sessions), opt.progress)

    def record(r: Result) -> None:
        results.append(r)
        progress.update()

    async def one_session(session: Session, first: Prepared, delay: float) -> None:
        await asyncio.sleep(delay)
        await _run_turns(backend, session, first, tokenizer, opt, sem, record)

    firsts = [prepare(s, 0, History.start(s), tokenizer, opt.ignore_eos) for s in sessions]
    delays = arrival_delays(len(sessions), opt.request_rate, opt.seed)
    start = time.perf_counter()
    await asyncio.gather(*(one_session(s, f, d) for s, f, d in zip(sessions, firsts, delays)))
    duration = time.perf_counter() - start
    progress.close()
    for r in results:
        r.client_output_tokens = len(tokenizer.encode(r.text)) if r.text else 0
    return results, duration


async def _run_turns(
    backend: Backend,
    session: Session,
    first: Prepared,
    tokenizer: ChatTokenizer,
    opt: RunOptions,
    sem: asyncio.Semaphore | None,
    record: Callable[[Result], None],
) -> None:
    history = History.start(session)
    for i, turn in enumerate(session.turns):
        req = first if i == 0 else prepare(session, i, history, tokenizer, opt.ignore_eos)
        async with sem if sem is not None else contextlib.nullcontext():
            result = await backend.send(req)
        record(result)
        if not result.success:
            for j in range(i + 1, session.num_requests):
                later = session.turns[j]
                record(Result(session.sid, j, 0, later.output_len).fail("skipped: an earlier turn failed"))
            return
        history.add(turn.content, result.text)
