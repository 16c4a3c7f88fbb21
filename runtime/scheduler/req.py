"""A request as the scheduler sees it: token ids, lengths, cache handles and output bookkeeping.

Length counters (all in tokens)::

    origin_input_ids            output_ids (processed)
    |------------------------------|----------------|
    |<- prefix_len ->|                                    shared with the radix tree (locked)
    |<------------- kv_len -------------------->|         KV computed or being computed
                                                          (row req_to_token[req_pool_idx, :kv_len])

``kv_len`` runs ahead of ``len(fill_ids)`` by one while a decode step is in flight in overlap mode
(its input token is the not-yet-processed output of the previous step).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import FinishReason, StopChecker

_stop_tags = itertools.count(1)


def next_stop_tag() -> int:
    """A tag no request has had in this process (early exit's device flags match on it)."""
    return next(_stop_tags)


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    params: SamplingParams
    stop_checker: StopChecker
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    stream: bool = False
    priority: int = 0
    extra_key: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    return_prefix_report: bool = False

    output_ids: list[int] = field(default_factory=list)
    # --- cache state (owned by the scheduler through the CacheManager)
    req_pool_idx: int | None = None
    kv_len: int = 0
    match: Any = None  # cache Match from the last lookup while waiting (not locked)
    handle: Any = None  # CacheHandle while admitted (holds the tree lock)
    # --- in-flight state
    extend_len: int = 0  # new tokens in the pass being built
    is_chunked: bool = False  # prefill not finished: continues on the next prefill step
    pending_outputs: int = 0  # launched steps whose token is not processed yet (overlap)
    # Chain decode launches of it in flight (``steps.chain``): while there are any, ``kv_len``
    # lags the positions the device has taken (the launches tell them when processed).
    chain_in_flight: int = 0
    # Of those, tokens launched before a jump-forward rewrote the output: they continue a text the
    # request no longer has, so processing throws them away (``Scheduler._jump_forward``).
    stale_outputs: int = 0
    # Early exit of continuous decode (executor/decode_exit.py): the device marks the request's
    # row with this tag when it samples a stop token. Renewed whenever device tokens of the
    # request are thrown away, so a mark they left never stops the steps after.
    stop_tag: int = field(default_factory=next_stop_tag)
    # Decode batches of this request processed at once because it might have ended
    # (``Scheduler._may_all_end``), which stops after ``NEAR_END_SYNCS``.
    near_end_syncs: int = 0
    # The most output tokens the request can end with, as its grammar tells from what the host
    # has seen (``Scheduler._output_cap``; None: no bound): like ``max_new_tokens``, no step is
    # launched past it, since the row has certainly stopped by then.
    output_cap: int | None = None
    future_ref: int = 0  # future-map index of the newest in-flight token (overlap)
    # --- reporting
    cached_tokens: int = 0
    cached_tokens_details: dict[str, int] | None = None  # {device, host, storage} at first admission
    num_retractions: int = 0
    first_admitted: bool = False
    prefix_report: dict[str, Any] | None = None  # prefix_walk.report_ids at first admission
    finished_reason: FinishReason | None = None
    grammar: Any = None  # GrammarMatcher or None
    grammar_future: Any = None  # Future[CompiledGrammar] while the grammar compiles
    grammar_on_device: bool = False  # compiling into a device automaton (grammar_queue)
    automaton: Any = None  # AutomatonEntry: the grammar masks on the device (grammar_queue)
    sent_output_len: int = 0  # output ids already sent to the detokenizer
    init_sent: bool = False
    # Logprobs accumulated since the last send: lists of wire pairs/lists.
    out_logprobs: list[list[Any]] = field(default_factory=list)
    out_top_logprobs: list[list[list[Any]]] = field(default_factory=list)
    out_token_ids_logprobs: list[list[list[Any]]] = field(default_factory=list)
    in_logprobs: list[list[Any]] = field(default_factory=list)
    in_top_logprobs: list[list[list[Any]]] = field(default_factory=list)
    in_token_ids_logprobs: list[list[list[Any]]] = field(default_factory=list)
    input_logprobs_done: bool = False
    # Speculative decoding: meta_info spec_verify_ct, spec_accept_length = accepted / verify_ct
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_budget: int = 0  # draft nodes the verified trees could hold (root excluded)

    def __post_init__(self) -> None:
        if not self.origin_input_ids:
            raise ValueError(f"request {self.rid}: empty input")
        if self.priority is None:
            self.priority = 0

    # ------------------------------------------------------------------ derived lengths
    @property
    def prefix_len(self) -> int:
        """Leading tokens shared with the tree: locked while admitted, last match while waiting."""
        if self.handle is not None:
            return self.handle.prefix_len
        return self.match.length if self.match is not None else 0

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV a fresh prefill would compute."""
        return self.origin_input_ids + self.output_ids

    def fill_slice(self, start: int, stop: int) -> list[int]:
        """``fill_ids[start:stop]`` (``0 <= start``) without building all of ``fill_ids``: a decode
        step reads one token of it per row."""
        n = len(self.origin_input_ids)
        if start >= n:
            return self.output_ids[start - n : max(stop - n, 0)]
        if stop <= n:
            return self.origin_input_ids[start:stop]
        return self.origin_input_ids[start:] + self.output_ids[: stop - n]

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def num_outputs_launched(self) -> int:
        """Output tokens sampled or being sampled (counts in-flight steps)."""
        return len(self.output_ids) + self.pending_outputs

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.params.max_new_tokens - self.num_outputs_launched, 0)

    @property
    def steps_left_at_most(self) -> int:
        """Decode steps after those launched by which the request has certainly ended: its
        budget, or its grammar's ``output_cap`` when that comes first."""
        left = self.remaining_new_tokens
        if self.output_cap is not None:
            left = min(left, max(self.output_cap - self.num_outputs_launched, 0))
        return left

    @property
    def wants_token(self) -> bool:
        """Not finished and ``remaining_new_tokens > 0``: a decode step has a row for it (read for
        every running request each step, hence spelled out)."""
        launched = len(self.output_ids) + self.pending_outputs
        return (
            self.finished_reason is None
            and self.params.max_new_tokens > launched
            and (self.output_cap is None or self.output_cap > launched)
        )

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.input_logprobs_done

    def match_cap(self) -> int:
        """Longest prefix that may come from the tree: at least one token must be computed, and
        input logprobs from ``logprob_start_len`` need the logits of the position before it."""
        cap = len(self.fill_ids) - 1
        if self.wants_input_logprobs:
            cap = min(cap, max(self.logprob_start_len - 1, 0))
        return max(cap, 0)

    def drop_stale(self, n: int) -> bool:
        """Whether the ``n`` tokens of this request's oldest launch in flight, now processed, are
        stale (launched before a jump); if so they are counted off and must be thrown away."""
        if not self.stale_outputs:
            return False
        self.stale_outputs -= n
        return True

    def finish(self, reason: FinishReason) -> None:
        if self.finished_reason is None:
            self.finished_reason = reason
