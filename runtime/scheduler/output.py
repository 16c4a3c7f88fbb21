"""Collects what each request produced in a step and sends it to the detokenizer in one message."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phloem.runtime.messages import BatchTokenOut, ReqOutInit, ReqTokenOut
from phloem.runtime.scheduler.req import Req


def _pairs(items: list[tuple[int, float]] | None) -> list[list[Any]]:
    return [[lp, tok] for tok, lp in (items or [])]


class OutputCollector:
    """Requests are marked with ``add`` while a step is processed; ``flush`` sends one
    ``BatchTokenOut``. Streaming requests send every ``stream_interval`` tokens; others only
    when they finish (the detokenizer then decodes everything at once)."""

    def __init__(self, send: Callable[[BatchTokenOut], None], *, stream_interval: int = 1) -> None:
        self._send = send
        self.stream_interval = max(stream_interval, 1)
        self._dirty: dict[int, Req] = {}

    def add(self, req: Req) -> None:
        """Mark ``req`` after its output or state changed. A request that neither streams nor has
        finished has nothing to send yet and is not kept (whoever finishes a request marks it
        again after ``finish``), which spares a decode step one entry per running request."""
        if req.stream or req.finished:
            self._dirty[id(req)] = req

    # ------------------------------------------------------------------ logprobs
    def record_logprobs(self, req: Req, lp: Any) -> None:
        self.record_input_logprobs(req, lp)
        token = req.output_ids[-1]
        if lp.output_logprob is not None:
            req.out_logprobs.append([lp.output_logprob, token])
        if req.top_logprobs_num > 0:
            req.out_top_logprobs.append(_pairs(lp.output_top))
        if req.token_ids_logprob:
            req.out_token_ids_logprobs.append(_pairs(lp.output_token_ids))

    def record_input_logprobs(self, req: Req, lp: Any) -> None:
        if lp.input_logprobs is None or req.input_logprobs_done:
            return
        start = max(req.logprob_start_len, 0)
        ids = req.fill_ids[start : start + len(lp.input_logprobs)]
        req.in_logprobs.extend([v, t] for v, t in zip(lp.input_logprobs, ids))
        if req.top_logprobs_num > 0 and lp.input_top is not None:
            req.in_top_logprobs.extend(_pairs(x) for x in lp.input_top)
        if req.token_ids_logprob and lp.input_token_ids is not None:
            req.in_token_ids_logprobs.extend(_pairs(x) for x in lp.input_token_ids)
        if start + len(lp.input_logprobs) >= req.prompt_len:
            req.input_logprobs_done = True

    # ------------------------------------------------------------------ sending
    def flush(self) -> None:
        if not self._dirty:
            return
        outs = [o for o in (self._build(r) for r in self._dirty.values()) if o is not None]
        self._dirty.clear()
        if outs:
            self._send(BatchTokenOut(outs=outs))

    def _build(self, req: Req) -> ReqTokenOut | None:
        new = len(req.output_ids) - req.sent_output_len
        finished = req.finished
        if not finished:
            if not req.stream or new <= 0:
                return None
            if new < self.stream_interval and req.sent_output_len > 0:
                return None
        out = ReqTokenOut(
            rid=req.rid,
            new_ids=req.output_ids[req.sent_output_len :],
            finished=_finish_wire(req) if finished else None,
            prompt_tokens=req.prompt_len,
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            cached_tokens_details=req.cached_tokens_details,
            num_retractions=req.num_retractions,
        )
        if not req.init_sent and req.prefix_report is not None:
            out.prefix_report = req.prefix_report
        if req.spec_verify_ct:
            accepted_drafts = req.spec_accepted_tokens - req.spec_verify_ct  # minus bonus tokens
            out.spec = {
                "spec_verify_ct": req.spec_verify_ct,
                "spec_accept_length": req.spec_accepted_tokens / req.spec_verify_ct,
                "spec_accept_rate": accepted_drafts / req.spec_draft_budget if req.spec_draft_budget else 0.0,
            }
        if not req.init_sent:
            p = req.params
            out.init = ReqOutInit(
                skip_special_tokens=p.skip_special_tokens,
                spaces_between_special_tokens=p.spaces_between_special_tokens,
                stop_strs=list(p.stop_strs),
                stream=req.stream,
                no_stop_trim=p.no_stop_trim,
            )
            req.init_sent = True
        if req.return_logprob:
            out.output_logprobs, req.out_logprobs = req.out_logprobs, []
            out.output_top_logprobs, req.out_top_logprobs = req.out_top_logprobs, []
            out.output_token_ids_logprobs, req.out_token_ids_logprobs = req.out_token_ids_logprobs, []
            out.input_logprobs, req.in_logprobs = req.in_logprobs, []
            out.input_top_logprobs, req.in_top_logprobs = req.in_top_logprobs, []
            out.input_token_ids_logprobs, req.in_token_ids_logprobs = req.in_token_ids_logprobs, []
        req.sent_output_len = len(req.output_ids)
        return out


def _finish_wire(req: Req) -> dict[str, Any] | None:
    reason = req.finished_reason
    if reason is None:
        return None
    wire = reason.to_wire()
    if reason.kind == "stop" and reason.tail_chars:
        wire["tail_chars"] = reason.tail_chars  # for trimming in the detokenizer only
    return wire
