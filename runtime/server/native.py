"""Native routes: SGLang's ``/generate`` and the admin routes (DESIGN.md §8).

The tokenizer manager is ``request.app.state.tm``. Everything here checks the shape of a request;
limits that need the tokenizer or the model (prompt length, ids in the vocabulary) are checked
cheaply here when the route can, and always again by the tokenizer manager.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.metrics import CONTENT_TYPE
from phloem.runtime.sampling.params import MAX_N, SamplingParams
from phloem.runtime.server import sse
from phloem.runtime.server.http_errors import ApiError, from_invalid_request, parse_body
from phloem.runtime.server.protocol import (
    AbortBody,
    DetokenizeBody,
    FlushCacheBody,
    GenerateBody,
    TokenizeBody,
    UpdateWeightsFromDiskBody,
    UpdateWeightsFromTensorBody,
)
from phloem.runtime.server.request_runner import (
    ClientDisconnected,
    Output,
    RequestRun,
    abort_error,
    openai_param,
    process_logprobs,
    raise_if_aborted,
    token_texter,
)
from phloem.runtime.tokenizer.request import GenerateRequest

logger = logging.getLogger(__name__)
router = APIRouter()

MAX_REQUESTS = 1024  # engine requests per HTTP request (batch x n)
HEALTH_GENERATE_TIMEOUT_S = 20.0


# ---- shared helpers (the OpenAI routes use them too) ----------------------------------------------
def get_tm(request: Request) -> Any:
    return request.app.state.tm


def require_serving(tm: Any) -> None:
    state = tm.health()
    if state != "serving":
        raise ApiError(503, f"server is not serving requests (state: {state})")


def to_api_error(exc: BaseException, tm: Any) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequest):
        return from_invalid_request(exc)
    logger.error("request failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
    status = 503 if tm.health() in ("shutting_down", "broken") else 500
    return ApiError(status, f"{type(exc).__name__}: {exc}")


def pop_n(wire: dict[str, Any], param: str) -> int:
    """Remove ``n`` from a sampling dict and check it (each sample becomes its own engine request)."""
    n = wire.pop("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int):
        raise ApiError(400, f"{param}: must be an integer", param=param)
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"{param}: must be between 1 and {MAX_N}, got {n}", param=param)
    return n


def sampling_for_samples(
    wire: dict[str, Any], n: int, *, names: dict[str, str] | None = None
) -> list[SamplingParams]:
    """``n`` validated SamplingParams; with a seed, sample ``j`` uses ``seed + j`` so samples differ."""
    seed = wire.get("sampling_seed")
    out = []
    for j in range(n):
        item = dict(wire)
        if j and isinstance(seed, int) and not isinstance(seed, bool):
            item["sampling_seed"] = seed + j
        out.append(from_wire(item, names=names))
    return out


def from_wire(wire: dict[str, Any], *, names: dict[str, str] | None = None) -> SamplingParams:
    """``SamplingParams.from_wire`` with its errors as 400s.

    Errors name ``sampling_params.<field>``; with ``names`` (wire name -> the client's name, for the
    OpenAI routes) they name the client's field instead (``max_tokens`` for ``max_new_tokens``).
    """
    try:
        return SamplingParams.from_wire(wire)
    except InvalidRequest as exc:
        param = exc.field if names is None else openai_param(exc.field, names)
        raise ApiError(400, f"{param}: {exc.message}", param=param) from None


def check_token_ids(ids: Sequence[int], vocab_size: int | None, param: str) -> None:
    for token in ids:
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise ApiError(
                400, f"{param}: token id {token} is outside the vocabulary [0, {vocab_size})", param=param
            )


def vocab_size(tm: Any) -> int | None:
    size = getattr(tm.tokenizer, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


# ---- /generate -----------------------------------------------------------------------------------
Prompt = tuple[str | None, list[int] | None]


def _prompts(body: GenerateBody, vocab: int | None) -> tuple[list[Prompt], bool]:
    """(prompts, is_batch) from ``text`` or ``input_ids`` (exactly one)."""
    if (body.text is None) == (body.input_ids is None):
        which = "both" if body.text is not None else "neither"
        raise ApiError(400, f"text: give exactly one of 'text' and 'input_ids' ({which} given)", param="text")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        if not texts:
            raise ApiError(400, "text: the batch is empty", param="text")
        for i, t in enumerate(texts):
            if not t:
                where = "text" if isinstance(body.text, str) else f"text.{i}"
                raise ApiError(400, f"{where}: must not be empty", param="text")
        return [(t, None) for t in texts], isinstance(body.text, list)
    ids = body.input_ids or []
    is_batch = bool(ids) and isinstance(ids[0], list)
    batch: list[list[int]] = ids if is_batch else [ids]  # type: ignore[assignment,list-item]
    if not ids:
        raise ApiError(400, "input_ids: must not be empty", param="input_ids")
    for i, row in enumerate(batch):
        where = f"input_ids.{i}" if is_batch else "input_ids"
        if not row:
            raise ApiError(400, f"{where}: must not be empty", param="input_ids")
        check_token_ids(row, vocab, "input_ids")
    return [(None, row) for row in batch], is_batch


def _per_item(value: Any, size: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != size:
            raise ApiError(400, f"{name}: has {len(value)} entries for a batch of {size}", param=name)
        return value
    return [value] * size


def _sampling_dicts(body: GenerateBody, size: int) -> list[dict[str, Any]]:
    sp = body.sampling_params
    if isinstance(sp, list) and len(sp) == 1 and size > 1:
        sp = sp[0]
    return [dict(d or {}) for d in _per_item(sp or {}, size, "sampling_params")]


def _rids(body: GenerateBody, size: int) -> list[str | None]:
    if body.rid is None:
        return [None] * size
    rids = [body.rid] if isinstance(body.rid, str) else body.rid
    if len(rids) != size:
        raise ApiError(400, f"rid: has {len(rids)} entries for a batch of {size}", param="rid")
    if len(set(rids)) != len(rids):
        raise ApiError(400, "rid: duplicate request ids", param="rid")
    return list(rids)


def _logprob_options(body: GenerateBody, size: int, vocab: int | None) -> list[dict[str, Any]]:
    returns = _per_item(body.return_logprob, size, "return_logprob")
    starts = _per_item(body.logprob_start_len, size, "logprob_start_len")
    tops = _per_item(body.top_logprobs_num, size, "top_logprobs_num")
    token_ids = body.token_ids_logprob
    if token_ids and isinstance(token_ids[0], list):
        ids_rows = _per_item(token_ids, size, "token_ids_logprob")
    else:
        ids_rows = [token_ids] * size
    options = []
    for ret, start, top, ids in zip(returns, starts, tops, ids_rows):
        if start < -1:
            raise ApiError(400, f"logprob_start_len: must be >= -1, got {start}", param="logprob_start_len")
        if top < 0 or (vocab is not None and top > vocab):
            raise ApiError(
                400,
                f"top_logprobs_num: must be between 0 and the vocabulary size, got {top}",
                param="top_logprobs_num",
            )
        check_token_ids(ids or [], vocab, "token_ids_logprob")
        options.append(
            {
                "return_logprob": ret,
                "logprob_start_len": start,
                "top_logprobs_num": top,
                "token_ids_logprob": list(ids) if ids else None,
            }
        )
    return options


def build_generate_requests(body: GenerateBody, tm: Any) -> tuple[list[GenerateRequest], bool]:
    """Engine requests for a /generate body, prompt-major (``i * n + j``), and whether to answer a list."""
    vocab = vocab_size(tm)
    prompts, is_batch = _prompts(body, vocab)
    size = len(prompts)
    wires, rids = _sampling_dicts(body, size), _rids(body, size)
    options = _logprob_options(body, size, vocab)
    reqs: list[GenerateRequest] = []
    answer_list = is_batch
    for (text, ids), wire, rid, opts in zip(prompts, wires, rids, options):
        n = pop_n(wire, "sampling_params.n")
        answer_list = answer_list or n > 1
        if len(reqs) + n > MAX_REQUESTS:
            raise ApiError(
                400,
                f"sampling_params.n: more than {MAX_REQUESTS} generations in one request",
                param="sampling_params.n",
            )
        for j, params in enumerate(sampling_for_samples(wire, n)):
            reqs.append(
                GenerateRequest(
                    text=text,
                    input_ids=ids,
                    sampling_params=params,
                    rid=rid if n == 1 or rid is None else f"{rid}-{j}",
                    return_text_in_logprobs=body.return_text_in_logprobs,
                    priority=body.priority,
                    extra_key=body.extra_key,
                    stream=body.stream,
                    **opts,
                )
            )
    return reqs, answer_list


def _present(out: Output, req: GenerateRequest, texter: Any) -> Output:
    out = dict(out)
    meta = out.get("meta_info")
    if req.return_logprob and isinstance(meta, dict):
        out["meta_info"] = meta = dict(meta)
        process_logprobs(meta, texter if req.return_text_in_logprobs else None)
    return out


@router.post("/generate")
async def generate(request: Request) -> Response:
    tm = get_tm(request)
    body = await parse_body(request, GenerateBody)
    require_serving(tm)
    reqs, answer_list = build_generate_requests(body, tm)
    run = RequestRun(tm, reqs, request)
    if body.stream:
        return await _stream_generate(run, reqs, answer_list, tm)
    try:
        outs = await run.finals()
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as exc:
        raise to_api_error(exc, tm) from None
    finally:
        run.close()
    raise_if_aborted(outs, tm.health())
    texter = token_texter(tm.tokenizer)
    outs = [_present(o, r, texter) for o, r in zip(outs, reqs)]
    return JSONResponse(outs if answer_list else outs[0])


async def _stream_generate(run: RequestRun, reqs: list[GenerateRequest], indexed: bool, tm: Any) -> Response:
    try:
        await run.prime()
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as exc:
        run.close()
        raise to_api_error(exc, tm) from None
    return sse.response(_generate_chunks(run, reqs, indexed, tm))


async def _generate_chunks(
    run: RequestRun, reqs: list[GenerateRequest], indexed: bool, tm: Any
) -> AsyncIterator[bytes]:
    texter = token_texter(tm.tokenizer)
    try:
        async for index, out in run.events():
            if out is None:
                continue
            err = abort_error(out, tm.health())
            if err is not None:
                yield sse.error_event(err)
                break
            chunk = _present(out, reqs[index], texter)
            if indexed:
                chunk["index"] = index
            yield sse.event(chunk)
    except ClientDisconnected:
        return
    except Exception as exc:
        yield sse.error_event(to_api_error(exc, tm))
    finally:
        run.close()
    yield sse.DONE


# ---- health and info -----------------------------------------------------------------------------
@router.get("/health")
async def health(request: Request) -> Response:
    state = get_tm(request).health()
    return JSONResponse({"status": state}, status_code=200 if state == "serving" else 503)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Run a one-token generation through the whole pipeline."""
    tm = get_tm(request)
    state = tm.health()
    if state != "serving":
        return JSONResponse({"status": state}, status_code=503)
    params = SamplingParams.from_wire({"max_new_tokens": 1, "temperature": 0.0})
    req = GenerateRequest(text="Hello", sampling_params=params, rid=f"health-{uuid.uuid4().hex}")
    run = RequestRun(tm, [req])
    try:
        outs = await asyncio.wait_for(run.finals(), HEALTH_GENERATE_TIMEOUT_S)
        raise_if_aborted(outs, tm.health())
    except Exception as exc:
        logger.warning("health_generate failed: %s: %s", type(exc).__name__, exc)
        return JSONResponse(
            {"status": "unhealthy", "message": str(exc) or type(exc).__name__}, status_code=503
        )
    finally:
        run.close()
    return JSONResponse({"status": "serving"})


def model_info_dict(tm: Any) -> dict[str, Any]:
    info = dict(tm.model_info)
    info.setdefault("model_path", None)
    info.setdefault("tokenizer_path", info["model_path"])
    info.setdefault("is_generation", True)
    info.setdefault("chat_template", None)
    info.setdefault("context_length", tm.context_len)
    info.setdefault("served_model_name", served_model_name(tm))
    return info


def served_model_name(tm: Any) -> str:
    return (
        tm.args.served_model_name
        or tm.model_info.get("served_model_name")
        or tm.model_info.get("model_path")
        or tm.args.model_path
        or "default"
    )


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> Response:
    return JSONResponse(jsonable_encoder(model_info_dict(get_tm(request))))


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> Response:
    info = await get_tm(request).get_server_info()
    return JSONResponse(jsonable_encoder(info, custom_encoder={float: _finite}))


def _finite(value: float) -> float | None:
    return value if value == value and value not in (float("inf"), float("-inf")) else None


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(get_tm(request).metrics.render(), media_type=CONTENT_TYPE)


# ---- cache, aborts, weights ----------------------------------------------------------------------
@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    timeout = _query_timeout(request)
    if request.method == "POST" and timeout is None:
        timeout = (await parse_body(request, FlushCacheBody)).timeout
    ok = await get_tm(request).flush_cache(timeout)
    if not ok:
        raise ApiError(400, "cannot flush the cache while requests are running")
    return JSONResponse({"success": True, "message": "cache flushed"})


def _query_timeout(request: Request) -> float | None:
    raw = request.query_params.get("timeout")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ApiError(400, f"timeout: not a number: {raw!r}", param="timeout") from None
    if not value >= 0:
        raise ApiError(400, "timeout: must be >= 0", param="timeout")
    return value


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    body = await parse_body(request, AbortBody)
    tm = get_tm(request)
    if body.abort_all:
        tm.abort(abort_all=True)
    elif body.rid:
        for rid in [body.rid] if isinstance(body.rid, str) else body.rid:
            tm.abort(rid)
    else:
        raise ApiError(400, "rid: give 'rid' or 'abort_all': true", param="rid")
    return JSONResponse({"success": True})


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> Response:
    body = await parse_body(request, UpdateWeightsFromDiskBody)
    ok, message = await get_tm(request).update_weights_from_disk(body.model_path)
    return JSONResponse({"success": bool(ok), "message": message}, status_code=200 if ok else 400)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> Response:
    body = await parse_body(request, UpdateWeightsFromTensorBody)
    ok, message = await get_tm(request).update_weights_from_tensor(body.tensor_file)
    return JSONResponse({"success": bool(ok), "message": message}, status_code=200 if ok else 400)


# ---- tokenizer -----------------------------------------------------------------------------------
@router.post("/v1/tokenize")
async def tokenize(request: Request) -> Response:
    body = await parse_body(request, TokenizeBody)
    tm = get_tm(request)
    encode = tm.tokenizer.encode
    if isinstance(body.prompt, str):
        tokens: Any = encode(body.prompt, add_special_tokens=body.add_special_tokens)
        count: Any = len(tokens)
    else:
        tokens = [encode(p, add_special_tokens=body.add_special_tokens) for p in body.prompt]
        count = [len(t) for t in tokens]
    return JSONResponse({"tokens": tokens, "count": count, "max_model_len": tm.context_len})


@router.post("/v1/detokenize")
async def detokenize(request: Request) -> Response:
    body = await parse_body(request, DetokenizeBody)
    tm = get_tm(request)
    rows = body.tokens if body.tokens and isinstance(body.tokens[0], list) else [body.tokens]
    for row in rows:
        check_token_ids(row, vocab_size(tm), "tokens")  # type: ignore[arg-type]
    texts = [tm.tokenizer.decode(row, skip_special_tokens=body.skip_special_tokens) for row in rows]
    return JSONResponse({"text": texts if rows is body.tokens else texts[0]})
