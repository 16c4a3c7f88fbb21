"""Admission as a budget object (docs/design.md §4).

A ``PrefillAdder`` is built once per scheduling round. It takes waiting requests in order while
three budgets hold:

- ``rem_total``: KV tokens the pool can still promise. It starts at what is free or evictable and
  is charged, for every running request, its remaining ``max_new_tokens`` x ``new_token_ratio``
  (exactly 1.0 for ``ignore_eos``, whose length is known). A new request must fit its new input
  tokens plus its *full* remaining ``max_new_tokens``.
- ``rem_input``: new tokens in this prefill pass (``max_prefill_tokens``).
- ``rem_chunk``: the chunk size; only the last admitted request may be cut, and it continues first
  on the next prefill step.

The adder only decides; the scheduler allocates. Matching and locking the prefix happen before a
request is offered (``prefix_len`` set), because the charge depends on it. The adder owns its
budgets: callers read them and change them only through its methods (``charge``, ``credit``,
``lift_forecast``, ``withdraw``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from phloem.runtime.scheduler.req import Req


class AddResult(enum.Enum):
    ADDED = 1
    NO_TOKEN = 2  # memory forecast exhausted: stop admitting this round
    NO_ROOM = 3  # token budget of this pass used up or running cap reached


def charged_future_tokens(req: Req, new_token_ratio: float) -> float:
    """Forecast of KV tokens a running (or mid-chunk) request will still need: the rest of its
    prompt, exactly, plus its remaining output scaled by the ratio."""
    ratio = 1.0 if req.params.ignore_eos else new_token_ratio
    unprocessed = max(len(req.fill_ids) - req.kv_len, 0)
    return unprocessed + req.remaining_new_tokens * ratio


class PrefillAdder:
    def __init__(
        self,
        *,
        available_tokens: int,
        running: Sequence[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunk_size: int | None,
        max_new_reqs: int,
    ) -> None:
        charged = sum(charged_future_tokens(r, new_token_ratio) for r in running)
        self._rem_total: float = available_tokens - charged
        self._rem_input = max_prefill_tokens
        self._rem_chunk = chunk_size if chunk_size is not None else max_prefill_tokens
        self._max_new_reqs = max_new_reqs
        self._can_run: list[Req] = []
        self._new_chunked: Req | None = None

    @property
    def rem_total(self) -> float:
        """KV tokens the pool can still promise this round."""
        return self._rem_total

    @property
    def rem_input(self) -> int:
        """New tokens this prefill pass may still take."""
        return self._rem_input

    @property
    def rem_chunk(self) -> int:
        """Tokens the chunk may still take (0 once a request was cut)."""
        return self._rem_chunk

    @property
    def can_run(self) -> list[Req]:
        """The requests admitted this round, in order (a copy)."""
        return list(self._can_run)

    @property
    def new_chunked(self) -> Req | None:
        """The admitted request that was cut: it continues first on the next prefill step."""
        return self._new_chunked

    @property
    def full(self) -> bool:
        return len(self._can_run) >= self._max_new_reqs or self._rem_input <= 0 or self._rem_chunk <= 0

    @property
    def takes_tokens(self) -> bool:
        """Whether this pass has tokens left, whatever the running cap."""
        return self._rem_chunk > 0 and self._rem_input > 0

    def covers(self, need: float) -> bool:
        """Whether the forecast can promise ``need`` more tokens."""
        return self._rem_total >= need

    def charge(self, tokens: float) -> None:
        """Take ``tokens`` off the forecast (slots that locking a prefix took out of the pool)."""
        self._rem_total -= tokens

    def credit(self, tokens: float) -> None:
        """Give ``tokens`` back to the forecast (a lock undone, a running request retracted)."""
        self._rem_total += tokens

    def lift_forecast(self) -> None:
        """Stop forecasting: nothing else runs, so a request is admitted if its pass fits at all."""
        self._rem_total = float("inf")

    def withdraw(self, req: Req) -> None:
        """Undo admitting ``req`` (its slots could not be allocated); it is no longer the cut one."""
        self._can_run.remove(req)
        if self._new_chunked is req:
            self._new_chunked = None

    def add_chunked(self, req: Req) -> None:
        """A request in the middle of a chunked prefill continues first, whatever the forecast
        (its memory was promised when it was admitted; the caller lists it among ``running`` so
        the rest of it is already charged)."""
        todo = len(req.fill_ids) - req.kv_len
        take = min(todo, self._rem_chunk, self._rem_input)
        self._take(req, take, total_todo=todo, charge=0)

    def add(self, req: Req, *, allow_chunk: bool = True) -> AddResult:
        if self.full:
            return AddResult.NO_ROOM
        todo = len(req.fill_ids) - req.prefix_len
        need = todo + req.remaining_new_tokens
        if need > self._rem_total:
            return AddResult.NO_TOKEN
        take = min(todo, self._rem_chunk, self._rem_input)
        if take < todo and not allow_chunk:
            # A request that may not be cut (input logprobs) waits for a pass of its own,
            # unless nothing else is in this pass: then it runs whole.
            if self._can_run:
                return AddResult.NO_ROOM
            take = todo
        if take <= 0:
            return AddResult.NO_ROOM
        self._take(req, take, total_todo=todo, charge=need)
        return AddResult.ADDED

    def _take(self, req: Req, take: int, *, total_todo: int, charge: float) -> None:
        req.extend_len = take
        req.is_chunked = take < total_todo
        if req.is_chunked:
            self._new_chunked = req
            self._rem_chunk = 0  # only the last request may be chunked
        else:
            self._rem_chunk -= take
        self._rem_input -= take
        self._rem_total -= charge
        self._can_run.append(req)
