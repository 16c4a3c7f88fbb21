"""One generate call -> the engine requests it stands for. Both entry points use it: the
``/generate`` route (its JSON body) and ``Engine.generate`` (its keyword arguments).

A call may carry a batch (a list of texts or of ``input_ids`` lists), per-item lists (sampling
params, logprob options, request ids) and ``n`` samples per prompt. :func:`expand` checks its
shape, builds each prompt's :class:`SamplingParams` once, and returns one ``GenerateRequest`` per
sample, prompt-major: request ``i * n + j`` is sample ``j`` of prompt ``i``. Sample ``j`` of a
request with rid ``r`` gets rid ``f"{r}-{j}"`` when ``n > 1``, and with a ``sampling_seed`` ``s``
the seed ``s + j``, so the samples differ from each other yet reproduce.

Every refusal is an :class:`InvalidRequest` naming the field (the HTTP layer answers 400 with it).
Limits that need the tokenized prompt (context length, ``logprob_start_len`` within the prompt)
are checked later, by the tokenizer manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgspec
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.sampling.params import SamplingParams, validate_token_ids
from phloem.runtime.tokenizer.request import GenerateRequest

MAX_REQUESTS = 1024  # engine requests per call (batch x n)
MAX_TOP_LOGPROBS_NUM = 100  # top alternatives per position: each is a row of the answer

# One prompt's sampling params as a caller may give them: the wire object, or already built.
SamplingSpec: TypeAlias = dict[str, Any] | SamplingParams | None


@dataclass(frozen=True, kw_only=True)
class GenerateCall:
    """The fields of a ``/generate`` body (SGLang's names); ``Engine.generate`` takes the same."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingSpec | list[SamplingSpec] = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    priority: int | None = None
    extra_key: str | None = None
    return_prefix_report: bool = False


def expand(call: GenerateCall, vocab_size: int | None = None) -> tuple[list[GenerateRequest], bool]:
    """The engine requests of ``call``, and whether the caller answers with a list (a batch, or
    ``n > 1``). ``vocab_size``: token ids are checked against it when given.

    Raises
    ------
    InvalidRequest
        When the call is malformed; the error names the field.
    """
    prompts, answer_list = _prompts(call, vocab_size)
    if call.priority is not None and not -(2**31) <= call.priority < 2**31:
        raise InvalidRequest("priority", f"must be a 32-bit integer, got {call.priority}")
    size = len(prompts)
    params = _sampling_params(call.sampling_params, size)
    rids = _rids(call.rid, size)
    logprobs = _logprob_options(call, size, vocab_size)
    reqs: list[GenerateRequest] = []
    for (text, ids), p, rid, opts in zip(prompts, params, rids, logprobs):
        if len(reqs) + p.n > MAX_REQUESTS:
            raise InvalidRequest("sampling_params.n", f"more than {MAX_REQUESTS} generations in one request")
        answer_list = answer_list or p.n > 1
        for j, sample in enumerate(per_sample(p)):
            reqs.append(
                GenerateRequest(
                    text=text,
                    input_ids=ids,
                    sampling_params=sample,
                    rid=rid if p.n == 1 or rid is None else f"{rid}-{j}",
                    return_text_in_logprobs=call.return_text_in_logprobs,
                    priority=call.priority,
                    extra_key=call.extra_key,
                    stream=call.stream,
                    return_prefix_report=call.return_prefix_report,
                    **opts,
                )
            )
    _check_unique([r.rid for r in reqs if r.rid is not None])
    return reqs, answer_list


def per_sample(params: SamplingParams) -> list[SamplingParams]:
    """``params.n`` sampling params of one sample each (``n == 1``); with a seed, sample ``j``
    uses ``sampling_seed + j``."""
    n, seed = params.n, params.sampling_seed
    first = params if n == 1 else msgspec.structs.replace(params, n=1)
    if seed is None:
        return [first] * n
    return [first] + [msgspec.structs.replace(first, sampling_seed=seed + j) for j in range(1, n)]


def tokenizer_vocab_size(tokenizer: Any) -> int | None:
    """The tokenizer's vocabulary size, or None when it does not say."""
    size = getattr(tokenizer, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


# ---- prompts -------------------------------------------------------------------------------------
Prompt = tuple[str | None, list[int] | None]


def _prompts(call: GenerateCall, vocab_size: int | None) -> tuple[list[Prompt], bool]:
    """(prompts, is_batch) from ``text`` or ``input_ids`` (exactly one)."""
    if (call.text is None) == (call.input_ids is None):
        which = "both" if call.text is not None else "neither"
        raise InvalidRequest("text", f"give exactly one of 'text' and 'input_ids' ({which} given)")
    if call.text is not None:
        return _text_prompts(call.text)
    return _ids_prompts(call.input_ids, vocab_size)  # type: ignore[arg-type]


def _text_prompts(text: str | Sequence[str]) -> tuple[list[Prompt], bool]:
    single = isinstance(text, str)
    texts: list[Any] = [text] if single else list(text)
    if not texts:
        raise InvalidRequest("text", "the batch is empty")
    for i, t in enumerate(texts):
        where = "text" if single else f"text.{i}"
        if not isinstance(t, str):
            raise InvalidRequest(where, "must be a string")
        if not t:
            raise InvalidRequest(where, "must not be empty")
    return [(t, None) for t in texts], not single


def _ids_prompts(ids: Sequence[Any], vocab_size: int | None) -> tuple[list[Prompt], bool]:
    if not ids:
        raise InvalidRequest("input_ids", "must not be empty")
    is_batch = isinstance(ids[0], list)
    rows: list[list[int]] = [list(row) for row in ids] if is_batch else [list(ids)]
    for i, row in enumerate(rows):
        where = f"input_ids.{i}" if is_batch else "input_ids"
        if not row:
            raise InvalidRequest(where, "must not be empty")
        _check_ids(row, vocab_size, where)
    return [(None, row) for row in rows], is_batch


def _check_ids(ids: list[int], vocab_size: int | None, field: str) -> None:
    """Checked here, before any request of the call starts; the tokenizer manager checks again
    against the model's vocabulary."""
    if vocab_size is not None:
        validate_token_ids(ids, vocab_size, field)


# ---- per-item fields -----------------------------------------------------------------------------
def _per_item(value: Any, size: int, name: str) -> list[Any]:
    """A list must have one entry per prompt; anything else applies to every prompt."""
    if isinstance(value, list):
        if len(value) != size:
            raise InvalidRequest(name, f"has {len(value)} entries for a batch of {size}")
        return value
    return [value] * size


def _sampling_params(spec: SamplingSpec | list[SamplingSpec], size: int) -> list[SamplingParams]:
    """One SamplingParams per prompt; a single object (or a list of one) applies to all, and an
    empty one means the defaults. Each is built once, here."""
    if isinstance(spec, list) and len(spec) <= 1:
        spec = spec[0] if spec else None
    specs = _per_item(spec, size, "sampling_params") if isinstance(spec, list) else [spec]
    built = [s if isinstance(s, SamplingParams) else SamplingParams.from_wire(s) for s in specs]
    return built if len(built) == size else built * size


def _rids(rid: str | list[str] | None, size: int) -> list[str | None]:
    if rid is None:
        return [None] * size
    return _per_item([rid] if isinstance(rid, str) else rid, size, "rid")


def _check_unique(rids: list[str]) -> None:
    seen: set[str] = set()
    for rid in rids:
        if rid in seen:
            raise InvalidRequest("rid", f"duplicate request id {rid!r}")
        seen.add(rid)


def _logprob_options(call: GenerateCall, size: int, vocab_size: int | None) -> list[dict[str, Any]]:
    """Each prompt's logprob fields of ``GenerateRequest``."""
    returns = _per_item(call.return_logprob, size, "return_logprob")
    starts = _per_item(call.logprob_start_len, size, "logprob_start_len")
    tops = _per_item(call.top_logprobs_num, size, "top_logprobs_num")
    token_ids = call.token_ids_logprob
    if token_ids and isinstance(token_ids[0], list):
        id_rows = _per_item(token_ids, size, "token_ids_logprob")
    else:
        id_rows = [token_ids] * size
    options = []
    for ret, start, top, ids in zip(returns, starts, tops, id_rows):
        if start < -1:
            raise InvalidRequest("logprob_start_len", f"must be >= -1, got {start}")
        if not 0 <= top <= MAX_TOP_LOGPROBS_NUM:
            raise InvalidRequest("top_logprobs_num", f"must be in [0, {MAX_TOP_LOGPROBS_NUM}], got {top}")
        _check_ids(list(ids or []), vocab_size, "token_ids_logprob")
        options.append(
            {
                "return_logprob": ret,
                "logprob_start_len": start,
                "top_logprobs_num": top,
                "token_ids_logprob": list(ids) if ids else None,
            }
        )
    return options
