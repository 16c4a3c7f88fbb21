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
request is offered (``prefix_len`` set), because the charge depends on it.
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
        self.rem_total = available_tokens - charged
        self.rem_input = max_prefill_tokens
        self.rem_chunk = chunk_size if chunk_size is not None else max_prefill_tokens
        self.max_new_reqs = max_new_reqs
        self.can_run: list[Req] = []
        self.new_chunked: Req | None = None

    @property
    def full(self) -> bool:
        return len(self.can_run) >= self.max_new_reqs or self.rem_input <= 0 or self.rem_chunk <= 0

    def add_chunked(self, req: Req) -> None:
        """A request in the middle of a chunked prefill continues first, whatever the forecast
        (its memory was promised when it was admitted; the caller lists it among ``running`` so
        the rest of it is already charged)."""
        todo = len(req.fill_ids) - req.kv_len
        take = min(todo, self.rem_chunk, self.rem_input)
        self._take(req, take, total_todo=todo, charge=0)

    def add(self, req: Req, *, allow_chunk: bool = True) -> AddResult:
        if self.full:
            return AddResult.NO_ROOM
        todo = len(req.fill_ids) - req.prefix_len
        need = todo + req.remaining_new_tokens
        if need > self.rem_total:
            return AddResult.NO_TOKEN
        take = min(todo, self.rem_chunk, self.rem_input)
        if take < todo and not allow_chunk:
            # A request that may not be cut (input logprobs) waits for a pass of its own,
            # unless nothing else is in this pass: then it runs whole.
            if self.can_run:
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
            self.new_chunked = req
            self.rem_chunk = 0  # only the last request may be chunked
        else:
            self.rem_chunk -= take
        self.rem_input -= take
        self.rem_total -= charge
        self.can_run.append(req)
