"""Native routes: SGLang's ``/generate`` and the admin routes (docs/design.md §8).

The tokenizer manager is ``request.app.state.tm``. ``/generate`` parses its body
(``GenerateBody``) and hands it to :func:`phloem.runtime.expand.expand`, which ``Engine.generate``
uses too: the two entry points accept and refuse the same calls. Limits that need the tokenized
prompt (its length against the context) are the tokenizer manager's.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import logging
import os
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.expand import GenerateCall, expand, per_sample, tokenizer_vocab_size
from phloem.runtime.metrics import CONTENT_TYPE
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.server import sse
from phloem.runtime.server.http_errors import ApiError, from_invalid_request, internal_error, parse_body
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

HEALTH_GENERATE_TIMEOUT_S = 20.0


# ---- shared helpers (the OpenAI routes use them too) ----------------------------------------------
def get_tm(request: Request) -> Any:
    return request.app.state.tm


def require_serving(tm: Any) -> None:
    """503 unless the engine serves: starting, stalled (the scheduler stopped beating), shutting
    down or broken. A stalled engine would leave the request waiting with no answer."""
    state = tm.health()
    if state != "serving":
        why = tm.health_message()
        raise ApiError(503, f"server is not serving requests (state: {state})" + (f": {why}" if why else ""))


def to_api_error(exc: BaseException, tm: Any) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequest):
        return from_invalid_request(exc)
    status = 503 if tm.health() in ("stalled", "shutting_down", "broken") else 500
    return internal_error(exc, "a request", status)


def sampling_for_samples(
    wire: dict[str, Any], n: int, *, names: dict[str, str] | None = None
) -> list[SamplingParams]:
    """The OpenAI routes' sampling params for the ``n`` samples of one prompt (``per_sample``).

    Errors are 400s naming ``sampling_params.<field>``; with ``names`` (wire name -> the client's
    name) they name the client's field instead (``max_tokens`` for ``max_new_tokens``).
    """
    try:
        return per_sample(SamplingParams.from_wire({**wire, "n": n}))
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
    return tokenizer_vocab_size(tm.tokenizer)


# ---- /generate -----------------------------------------------------------------------------------
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
    unsupported = body.unsupported()
    if unsupported is not None:
        raise ApiError(400, f"{unsupported}: not supported by this server", param=unsupported)
    require_serving(tm)
    # a malformed call raises InvalidRequest: the app's handler answers 400 naming the field
    call = GenerateCall(**{f.name: getattr(body, f.name) for f in dataclasses.fields(GenerateCall)})
    reqs, answer_list = expand(call, vocab_size(tm))
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
    """200 while serving; else 503 with the state and, when known, why (a stalled scheduler: no
    heartbeat, or a loop that stopped moving; a broken engine: what broke it)."""
    tm = get_tm(request)
    state = tm.health()
    return JSONResponse(_state_body(tm, state), status_code=200 if state == "serving" else 503)


def _state_body(tm: Any, state: str) -> dict[str, str]:
    message = tm.health_message() if state != "serving" else ""
    return {"status": state, "message": message} if message else {"status": state}


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Run a one-token generation through the whole pipeline."""
    tm = get_tm(request)
    state = tm.health()
    if state != "serving":
        return JSONResponse(_state_body(tm, state), status_code=503)
    held = tm.held() if hasattr(tm, "held") else ""
    if held:  # a probe would wait with the held requests until its timeout
        return JSONResponse({"status": "held", "message": held}, status_code=503)
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
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


def model_aliases(tm: Any) -> set[str]:
    """The ``model`` names a request may give: the served name, ``default``, and the model's path
    as given or resolved, with its file name and that name's stem (``x.gguf`` -> ``x``)."""
    names = {served_model_name(tm), "default"}
    for path in (tm.args.model_path, tm.model_info.get("model_path")):
        if path:
            base = os.path.basename(os.path.normpath(str(path)))
            names.update({str(path), base, os.path.splitext(base)[0]})
    return names


def check_model(model: str | None, tm: Any) -> None:
    """404 ``model_not_found`` for a ``model`` this server does not serve, as the OpenAI API
    answers; no ``model`` at all means the served one."""
    if model is not None and model not in model_aliases(tm):
        raise ApiError(
            404,
            f"model: the model '{model}' does not exist on this server; it serves "
            f"'{served_model_name(tm)}' (GET /v1/models)",
            param="model",
            type_="invalid_request_error",
            code="model_not_found",
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


@router.get("/metrics", response_class=PlainTextResponse)  # Prometheus text, as the schema says
async def metrics(request: Request) -> Response:
    return Response(get_tm(request).metrics.render(), media_type=CONTENT_TYPE)


# ---- cache, aborts, weights ----------------------------------------------------------------------
@router.get("/flush_cache", operation_id="flush_cache_get")
@router.post("/flush_cache", operation_id="flush_cache_post")
async def flush_cache(request: Request) -> Response:
    timeout = _query_timeout(request)
    if request.method == "POST" and timeout is None:
        timeout = (await parse_body(request, FlushCacheBody)).timeout
    require_serving(get_tm(request))
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
    try:
        body = await parse_body(request, UpdateWeightsFromDiskBody)
        require_serving(get_tm(request))
        _check_update_options(body)
    except ApiError as err:
        return weights_failure(request, err)
    reply = await get_tm(request).update_weights_from_disk(
        body.model_path, load_format=body.load_format, abort_all_requests=body.abort_all_requests
    )
    return weights_response(request, reply, body.weight_version)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> Response:
    try:
        body = await parse_body(request, UpdateWeightsFromTensorBody)
        require_serving(get_tm(request))
        _check_update_options(body)
        if body.load_format is not None:
            raise ApiError(400, "load_format: not supported for tensors (send safetensors)", param="load_format")
        data = _inline_tensors(body)
    except ApiError as err:
        return weights_failure(request, err)
    tm = get_tm(request)
    if data is not None:
        reply = await tm.update_weights_from_tensor(
            tensor_data=data, field="safetensors_b64", abort_all_requests=body.abort_all_requests
        )
    else:
        reply = await tm.update_weights_from_tensor(
            tensor_file=body.tensor_file, field="tensor_file", abort_all_requests=body.abort_all_requests
        )
    return weights_response(request, reply, body.weight_version)


def _check_update_options(body: UpdateWeightsFromDiskBody | UpdateWeightsFromTensorBody) -> None:
    if not body.flush_cache:
        raise ApiError(
            400,
            "flush_cache: must be true: the prefix cache is always flushed after an update (its KV "
            "came from the old weights)",
            param="flush_cache",
        )


def _inline_tensors(body: UpdateWeightsFromTensorBody) -> bytes | None:
    """The decoded ``safetensors_b64`` (``None`` when the body names a ``tensor_file``)."""
    if body.serialized_named_tensors is not None:
        raise ApiError(
            400,
            "serialized_named_tensors: pickled tensors are not accepted; send safetensors_b64 or tensor_file",
            param="serialized_named_tensors",
        )
    if (body.tensor_file is None) == (body.safetensors_b64 is None):
        raise ApiError(
            400, "tensor_file: give exactly one of 'tensor_file' and 'safetensors_b64'", param="tensor_file"
        )
    if body.safetensors_b64 is None:
        return None
    try:
        return base64.b64decode(body.safetensors_b64, validate=True)
    except binascii.Error as e:
        raise ApiError(400, f"safetensors_b64: not base64: {e}", param="safetensors_b64") from None


def weights_response(request: Request, reply: Any, weight_version: str | None = None) -> Response:
    """SGLang's ``{"success", "message"}`` body. A refusal is a 400 naming the field, an engine
    fault a 500 whose details stay in the server log, and an engine that is shutting down or
    broken a 503."""
    if reply.ok:
        if weight_version is not None:  # reported by /get_model_info from now on
            get_tm(request).model_info["weight_version"] = weight_version
        return JSONResponse({"success": True, "message": reply.message})
    field = reply.data.get("field")
    if reply.data.get("internal"):
        return weights_failure(request, ApiError(500, "internal error"))
    if field:
        return weights_failure(request, ApiError(400, reply.message, param=field))
    return weights_failure(request, ApiError(503, reply.message))


def weights_failure(request: Request, err: ApiError) -> Response:
    """The shared error body plus SGLang's ``success: false`` and ``message``, which weight-update
    clients read."""
    logger.warning("refused %s %s: %d %s", request.method, request.url.path, err.status, err.message[:300])
    return JSONResponse({"success": False, "message": err.message, **err.body()}, status_code=err.status)


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


@router.get("/tokenizer")
async def tokenizer_files(request: Request) -> Response:
    """The server's tokenizer as the contents of a Hugging Face folder's files (see
    ``Tokenizer.to_hf_files``), so a remote client tokenizes exactly as the server does. The body is
    built once, off the event loop (a 128k vocabulary is megabytes of JSON), and kept."""
    state = request.app.state
    body = getattr(state, "tokenizer_files", None)
    if body is None:
        export = getattr(get_tm(request).tokenizer, "to_hf_files", None)
        if export is None:
            raise ApiError(404, "this server's tokenizer cannot be exported")
        body = await asyncio.to_thread(lambda: JSONResponse(export()).body)
        state.tokenizer_files = body
    return Response(body, media_type="application/json")


@router.post("/v1/detokenize")
async def detokenize(request: Request) -> Response:
    body = await parse_body(request, DetokenizeBody)
    tm = get_tm(request)
    rows = body.tokens if body.tokens and isinstance(body.tokens[0], list) else [body.tokens]
    for row in rows:
        check_token_ids(row, vocab_size(tm), "tokens")  # type: ignore[arg-type]
    texts = [tm.tokenizer.decode(row, skip_special_tokens=body.skip_special_tokens) for row in rows]
    return JSONResponse({"text": texts if rows is body.tokens else texts[0]})
