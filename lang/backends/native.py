"""Shared mapping for backends that speak SGLang's native ``/generate`` contract (docs/design.md §8).

:class:`RuntimeEndpoint` (HTTP) and :class:`EngineBackend` (in-process) differ only in how a payload
travels; this module builds the payloads and reads the responses.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

from phloem.lang.backends.base import (
    Backend,
    BackendError,
    GenerateOutput,
    GenerateRequest,
    SelectRequest,
    StreamChunk,
)
from phloem.lang.choices import ChoiceLogprobs, healed_boundary, tail_logprobs
from phloem.lang.ir import Constraint, LogprobOptions, SamplingParams

Payload = dict[str, Any]

# DSL name -> wire name, where they differ.
_WIRE_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}


def sampling_params_payload(params: SamplingParams, constraint: Constraint | None = None) -> Payload:
    """``sampling_params`` for a request: only the fields that are set, by wire name."""
    out: Payload = {}
    for name, value in params.set_fields().items():
        out[_WIRE_NAMES.get(name, name)] = list(value) if isinstance(value, tuple) else value
    if constraint is not None:
        out[constraint.kind] = constraint.spec
    return out


def logprob_payload(options: LogprobOptions) -> Payload:
    """The top-level logprob fields, empty unless logprobs were asked for."""
    if not options.return_logprob:
        return {}
    out: Payload = {"return_logprob": True, "return_text_in_logprobs": True}
    if options.logprob_start_len is not None:
        out["logprob_start_len"] = options.logprob_start_len
    if options.top_logprobs_num is not None:
        out["top_logprobs_num"] = options.top_logprobs_num
    return out


def generate_payload(request: GenerateRequest, *, stream: bool = False) -> Payload:
    """The ``/generate`` body for one DSL generation."""
    payload: Payload = {
        "text": request.text,
        "sampling_params": sampling_params_payload(request.params, request.constraint),
        **logprob_payload(request.logprobs),
    }
    if stream:
        payload["stream"] = True
    return payload


def prefill_payload(texts: str | list[str], *, logprob_start_len: int | None = None) -> Payload:
    """A prefill-only request (``max_new_tokens: 0``), with input logprobs when a start is given."""
    payload: Payload = {"text": texts, "sampling_params": {"max_new_tokens": 0}}
    if logprob_start_len is not None:
        payload.update(return_logprob=True, logprob_start_len=logprob_start_len, return_text_in_logprobs=True)
    return payload


def check_not_aborted(item: Payload) -> Payload:
    """Raise when a response reports an abort: an error must never look like success."""
    reason = (item.get("meta_info") or {}).get("finish_reason") or {}
    if isinstance(reason, dict) and reason.get("type") == "abort":
        raise BackendError(f"request aborted: {reason.get('message', 'no message')}")
    return item


def as_items(response: Payload | list[Payload]) -> list[Payload]:
    """A batch response is a list; a single one becomes a list of one."""
    items = response if isinstance(response, list) else [response]
    return [check_not_aborted(item) for item in items]


class NativeBackend(Backend):
    """A backend whose transport carries SGLang-native payloads."""

    @abstractmethod
    def _send(self, payload: Payload) -> Payload | list[Payload]:
        """Send one ``/generate`` payload and return the decoded response."""

    @abstractmethod
    def _send_stream(self, payload: Payload) -> Iterator[Payload]:
        """Send a streaming payload; yield each cumulative chunk."""

    def generate(self, request: GenerateRequest) -> GenerateOutput:
        items = as_items(self._send(generate_payload(request)))
        return GenerateOutput(
            texts=tuple(item.get("text", "") for item in items),
            meta_infos=tuple(item.get("meta_info") or {} for item in items),
        )

    def generate_stream(self, request: GenerateRequest) -> Iterator[StreamChunk]:
        sent = ""
        meta: dict[str, Any] = {}
        for chunk in self._send_stream(generate_payload(request, stream=True)):
            check_not_aborted(chunk)
            text = chunk.get("text", "")
            meta = chunk.get("meta_info") or meta
            if len(text) > len(sent):
                yield StreamChunk(delta=text[len(sent) :])
                sent = text
        yield StreamChunk(delta="", meta_info=meta)

    def cache_prefix(self, text: str) -> None:
        as_items(self._send(prefill_payload(text)))

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text as the server tokenizes prompts.

        This default reads them back from a prefill with ``logprob_start_len: 0``; transports with a
        tokenizer endpoint override it.
        """
        items = as_items(self._send(prefill_payload(list(texts), logprob_start_len=0)))
        return [[int(e[1]) for e in item["meta_info"]["input_token_logprobs"]] for item in items]

    def choice_logprobs(self, request: SelectRequest) -> ChoiceLogprobs:
        fulls = [request.prefix + c for c in request.choices]
        prefix_ids, *full_ids = self.tokenize([request.prefix, *fulls])
        counts = [len(ids) - healed_boundary(prefix_ids, ids) for ids in full_ids]
        # Two tokens of slack: a tokenizer endpoint and /generate may disagree about BOS.
        start = max(min(len(ids) - n for ids, n in zip(full_ids, counts)) - 2, 0)
        items = as_items(self._send(prefill_payload(fulls, logprob_start_len=start)))
        conditional = tuple(
            tail_logprobs(item["meta_info"]["input_token_logprobs"], n) for item, n in zip(items, counts)
        )
        return ChoiceLogprobs(conditional=conditional, unconditional=self._unconditional(request))

    def _unconditional(self, request: SelectRequest) -> tuple[tuple[float, ...], ...] | None:
        if not request.unconditional:
            return None
        items = as_items(self._send(prefill_payload(list(request.choices), logprob_start_len=0)))
        return tuple(
            tuple(float(e[0]) for e in item["meta_info"]["input_token_logprobs"] if e[0] is not None)
            for item in items
        )
