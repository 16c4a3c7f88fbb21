"""Launching and processing a plain forward pass (prefill, decode, continuous decode).

Shared by the step kinds that run the target model's own pass: what each row's inputs are, and
what each row's sampled token means once it is known.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from phloem.runtime.forward_io import ForwardOutput
from phloem.runtime.sampling.stop import FinishReason
from phloem.runtime.scheduler.batch import ScheduledBatch, build_forward_input, gather_new_tokens
from phloem.runtime.scheduler.policy import stop_rows
from phloem.runtime.scheduler.req import Req

if TYPE_CHECKING:
    from phloem.runtime.scheduler.scheduler import Scheduler


def launch_forward(s: Scheduler, batch: ScheduledBatch, vocab_mask: Any) -> Future[Any]:
    """Build the batch's ``ForwardInput`` and submit it. Rows advance ``kv_len`` now and wait
    for their tokens through future ids (``pending_outputs``)."""
    future_ids = s.worker.future_map.reserve(len(batch.reqs))
    ids = gather_new_tokens(batch)
    sampling = s.sampling.build(batch.reqs, vocab_mask=vocab_mask)
    auto = s.grammar.automaton_rows(batch.reqs, batch.discard) if s.grammar is not None else None
    if auto is not None:  # read before pending_outputs counts this launch
        sampling.automaton, sampling.automaton_rows, sampling.automaton_init = auto
    if batch.decode_steps > 1 and s.cfg.decode_early_exit:
        stop_ids, tags = stop_rows(batch.reqs, s.grammar.stop_token_ids if s.grammar is not None else ())
        sampling.stop_ids = torch.tensor(stop_ids, dtype=torch.int64)
        sampling.stop_tags = torch.tensor(tags, dtype=torch.int64)
    fi = build_forward_input(batch, req_to_token=s.req_pool.req_to_token, input_ids=ids, sampling=sampling)
    # EAGLE follows every computed token: plain passes return the target's hidden states
    fi.return_hidden_states = s.spec is not None and s.spec.needs_hidden
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
            passes = s.prefilling.get(id(req), (req, 0))[1]
            s.prefilling[id(req)] = (req, passes + 1)
        # A request whose prefill completes joins the running set now, so the next step
        # (which may be launched before this one is processed) already decodes it.
        if is_prefill and not discard and req not in s.running:
            s.running.append(req)
    return s.worker.submit(fi, future_ids)


def process_rows(s: Scheduler, batch: ScheduledBatch, out: ForwardOutput, tokens: list[int]) -> None:
    """Each row's result: discarded rows, prefill rows entering the tree, logprobs, the drafter."""
    plain: list[tuple[int, int, Any]] = []  # (row, token, feature) of plain decode rows, for the drafter
    for i, req in enumerate(batch.reqs):
        if batch.prefill_row[i]:
            _prefill_processed(s, req)
        lp = out.logprobs[i] if out.logprobs is not None else None
        if s.spec is not None:
            _follow_spec(s, batch, i, req, tokens[i], out, plain)
        if batch.discard[i]:
            _after_discarded_row(s, req, lp, is_chunk=batch.chunk[i], done=batch.prefix_lens[i] + batch.extend_lens[i])
            continue
        req.pending_outputs -= 1
        if req.drop_stale(1) or req.finished:
            continue
        if batch.prefill_row[i] and batch.prefix_lens[i] < req.prompt_len:
            # prompt tokens enter the tree now; a jump-forward extend computes output tokens
            # only, which enter it when the request ends, as decoded ones do
            s.share_prefix(req, batch.prefix_lens[i] + batch.extend_lens[i])
        s.append_token(req, tokens[i], lp)
    if plain:
        assert s.spec is not None
        s.spec.on_plain_steps(*map(list, zip(*plain)))  # one catch-up pass for every row


def _prefill_processed(s: Scheduler, req: Req) -> None:
    _, passes = s.prefilling.pop(id(req), (req, 0))
    if passes > 1:
        s.prefilling[id(req)] = (req, passes - 1)


def _follow_spec(
    s: Scheduler, batch: ScheduledBatch, i: int, req: Req, token: int, out: ForwardOutput, plain: list[tuple[int, int, Any]]
) -> None:
    """Keep the drafter in step with plain passes: prefill chunks hand over their features,
    the last chunk starts the drafter, a plain decode step advances it (collected in
    ``plain``; the caller hands them over together)."""
    if req.finished:
        return
    assert s.spec is not None
    offset = sum(batch.extend_lens[:i])
    n = batch.extend_lens[i]
    hidden = None if out.hidden_states is None else out.hidden_states[offset : offset + n]
    if not batch.prefill_row[i]:
        if not batch.discard[i]:
            plain.append((req.req_pool_idx, token, hidden))
        return
    if hidden is not None:
        s.spec.on_extend(req.req_pool_idx, batch.prefix_lens[i], hidden)
    if not batch.discard[i]:  # the last chunk: its sampled token is the first output
        s.spec.on_prefill_done(req.req_pool_idx, req.fill_ids, token)


def _after_discarded_row(s: Scheduler, req: Req, lp: Any, *, is_chunk: bool, done: int) -> None:
    if req.finished:
        return
    if lp is not None:
        s.outputs.record_input_logprobs(req, lp)
    if is_chunk:
        s.share_prefix(req, done)
        return
    # prefill-only request (max_new_tokens == 0)
    req.finish(FinishReason.length(0))
    s.outputs.add(req)
    s.release(req)
