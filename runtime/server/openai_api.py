"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Each body becomes engine requests in SGLang's wire names (``max_tokens`` -> ``max_new_tokens``,
``seed`` -> ``sampling_seed`` ...), runs through ``RequestRun`` like ``/generate``, and the SGLang
outputs are rewritten into OpenAI objects. Choices are prompt-major: choice ``i * n + j`` is sample
``j`` of prompt ``i``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.sampling.params import MAX_N
from phloem.runtime.server import sse
from phloem.runtime.server.http_errors import ApiError, parse_body
from phloem.runtime.server.native import (
    check_model,
    check_token_ids,
    get_tm,
    require_serving,
    sampling_for_samples,
    served_model_name,
    to_api_error,
    vocab_size,
)
from phloem.runtime.server.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    _SamplingFields,
    unknown_fields,
)
from phloem.runtime.server.request_runner import (
    ClientDisconnected,
    Output,
    RequestRun,
    abort_error,
    finish_reason,
    openai_param,
    process_logprobs,
    raise_if_aborted,
    token_texter,
)
from phloem.runtime.server.tool_calls import (
    StreamingToolCalls,
    ToolCallParser,
    load_parser,
    template_renders_tools,
)
from phloem.runtime.tokenizer.request import GenerateRequest
from pydantic import BaseModel

router = APIRouter()

MAX_TOP_LOGPROBS = 20
# SamplingParams field -> the OpenAI field a client sent, for error messages.
WIRE_TO_OPENAI = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
COMPLETION_NAMES = {**WIRE_TO_OPENAI, "text": "prompt", "input_ids": "prompt"}
# a chat's structural tag comes only from its tools (a forced call): the tools' schemas are at fault
CHAT_NAMES = {
    **WIRE_TO_OPENAI,
    "text": "messages",
    "input_ids": "messages",
    "json_schema": "response_format",
    "structural_tag": "tools",
}
# OpenAI (or extra) field -> SamplingParams wire name, copied when not None.
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "ignore_eos": "ignore_eos",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "regex": "regex",
    "ebnf": "ebnf",
    "logit_bias": "logit_bias",
    "seed": "sampling_seed",
    "logprob_mode": "logprob_mode",
}


# ---- shared --------------------------------------------------------------------------------------
def _check_n(n: int) -> int:
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n: must be between 1 and {MAX_N}, got {n}", param="n")
    return n


def _check_top_logprobs(value: int | None, param: str) -> int:
    if value is None:
        return 0
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{param}: must be between 0 and {MAX_TOP_LOGPROBS}, got {value}", param=param)
    return value


def sampling_wire(body: _SamplingFields, max_new_tokens: int | None) -> dict[str, Any]:
    wire: dict[str, Any] = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    for src, dst in _SAMPLING_FIELDS.items():
        value = getattr(body, src)
        if value is not None:
            wire[dst] = value
    if body.json_schema is not None:
        schema = body.json_schema
        wire["json_schema"] = schema if isinstance(schema, str) else json.dumps(schema)
    return wire


def _openai_finish(out: Output) -> str | None:
    """OpenAI's finish reason; a request the caller aborted ends with "abort", as on SGLang."""
    reason = finish_reason(out)
    if not reason:
        return None
    kind = reason.get("type")
    return kind if kind in ("length", "abort") else "stop"


def _matched_stop(out: Output) -> Any:
    reason = finish_reason(out) or {}
    return reason.get("matched")


def _meta(out: Output) -> dict[str, Any]:
    return out.get("meta_info") or {}


def usage(outs: Sequence[Output], n: int) -> dict[str, Any]:
    """Prompt tokens counted once per prompt (the first of its ``n`` samples), completions summed."""
    firsts = [_meta(o) for o in outs[::n]]
    prompt = sum(int(m.get("prompt_tokens") or 0) for m in firsts)
    cached = sum(int(m.get("cached_tokens") or 0) for m in firsts)
    completion = sum(int(_meta(o).get("completion_tokens") or 0) for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _present(out: Output, texter: Callable[[int], str]) -> Output:
    """A copy of ``out`` with logprob texts filled and -inf clamped."""
    out = dict(out)
    meta = dict(_meta(out))
    process_logprobs(meta, texter)
    out["meta_info"] = meta
    return out


def _api_error(exc: BaseException, tm: Any, names: dict[str, str]) -> ApiError:
    """``to_api_error`` with the engine's field names turned into the client's."""
    if isinstance(exc, InvalidRequest) and exc.field:
        param = openai_param(exc.field, names)
        return ApiError(400, f"{param}: {exc.message}", param=param)
    return to_api_error(exc, tm)


async def _finals(run: RequestRun, tm: Any, names: dict[str, str]) -> list[Output] | None:
    """Final outputs, or None when the client went away."""
    try:
        outs = await run.finals()
    except ClientDisconnected:
        return None
    except Exception as exc:
        raise _api_error(exc, tm, names) from None
    finally:
        run.close()
    raise_if_aborted(outs, tm.health(), names)
    return outs


async def _prime(run: RequestRun, tm: Any, names: dict[str, str]) -> bool:
    """Wait for every request's first output; False when the client went away."""
    try:
        await run.prime(names)
    except ClientDisconnected:
        return False
    except Exception as exc:
        run.close()
        raise _api_error(exc, tm, names) from None
    return True


async def _events(
    run: RequestRun, tm: Any, names: dict[str, str]
) -> AsyncIterator[tuple[int, Output | None] | ApiError]:
    """The run's events; an error (exception or abort) is yielded as an ``ApiError`` and ends it."""
    try:
        async for index, out in run.events():
            err = abort_error(out, tm.health(), names) if out is not None else None
            if err is not None:
                yield err
                return
            yield index, out
    except ClientDisconnected:
        return
    except Exception as exc:
        yield _api_error(exc, tm, names)
    finally:
        run.close()


async def refuse_unknown_fields(request: Request, body: BaseModel, tm: Any) -> None:
    """Under ``--strict-api``, a 400 naming the first key of the body that no field takes."""
    if not tm.args.strict_api:
        return
    unknown = unknown_fields(body, json.loads(await request.body() or b"{}"))
    if unknown:
        raise ApiError(400, f"{unknown[0]}: unrecognized request argument", param=unknown[0])


# ---- /v1/models ----------------------------------------------------------------------------------
@router.get("/v1/models")
async def models(request: Request) -> Response:
    tm = get_tm(request)
    card = {
        "id": served_model_name(tm),
        "object": "model",
        "created": int(time.time()),
        "owned_by": "phloem",
        "root": tm.model_info.get("model_path"),
        "max_model_len": tm.context_len,
    }
    return JSONResponse({"object": "list", "data": [card]})


# ---- /v1/completions -----------------------------------------------------------------------------
Prompt = tuple[str | None, list[int] | None]


def _completion_prompts(body: CompletionRequest, vocab: int | None) -> list[Prompt]:
    prompt = body.prompt
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    prompts: list[Prompt] = []
    for item in items:
        if not item:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        if isinstance(item, str):
            prompts.append((item, None))
        else:
            check_token_ids(item, vocab, "prompt")
            prompts.append((None, list(item)))
    return prompts


def _completion_requests(body: CompletionRequest, prompts: list[Prompt], rid: str) -> list[GenerateRequest]:
    n = _check_n(body.n)
    top = _check_top_logprobs(body.logprobs, "logprobs")
    wire = sampling_wire(body, body.max_tokens)
    reqs = []
    for i, (text, ids) in enumerate(prompts):
        for j, params in enumerate(sampling_for_samples(wire, n, names=COMPLETION_NAMES)):
            reqs.append(
                GenerateRequest(
                    text=text,
                    input_ids=ids,
                    sampling_params=params,
                    rid=f"{rid}-{i * n + j}",
                    return_logprob=body.logprobs is not None,
                    top_logprobs_num=top,
                    logprob_start_len=0 if body.echo and body.logprobs is not None else -1,
                    return_text_in_logprobs=True,
                    stream=body.stream,
                    return_prefix_report=body.return_prefix_report,
                )
            )
    return reqs


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    tm = get_tm(request)
    body = await parse_body(request, CompletionRequest)
    await refuse_unknown_fields(request, body, tm)
    check_model(body.model, tm)
    require_serving(tm)
    if body.suffix:
        raise ApiError(400, "suffix: not supported", param="suffix")
    prompts = _completion_prompts(body, vocab_size(tm))
    rid = _response_id("cmpl")
    reqs = _completion_requests(body, prompts, rid)
    run = RequestRun(tm, reqs, request)
    echoes = [_echo_text(p, tm) if body.echo else "" for p in prompts for _ in range(body.n)]
    ctx = _Ctx(rid, int(time.time()), served_model_name(tm), body.n, token_texter(tm.tokenizer))
    if body.stream:
        if not await _prime(run, tm, COMPLETION_NAMES):
            return Response(status_code=499)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _completion_chunks(run, tm, ctx, echoes, body.echo, body.logprobs is not None, include_usage)
        return sse.response(chunks)
    outs = await _finals(run, tm, COMPLETION_NAMES)
    if outs is None:
        return Response(status_code=499)
    outs = [_present(o, ctx.texter) for o in outs]
    choices = [
        _completion_choice(i, o, echoes[i], body.echo, body.logprobs is not None) for i, o in enumerate(outs)
    ]
    return JSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": ctx.created,
            "model": ctx.model,
            "choices": choices,
            "usage": usage(outs, body.n),
        }
    )


@dataclass
class _Ctx:
    rid: str
    created: int
    model: str
    n: int
    texter: Callable[[int], str]


def _echo_text(prompt: Prompt, tm: Any) -> str:
    text, ids = prompt
    return text if text is not None else tm.tokenizer.decode(ids or [], skip_special_tokens=False)


def _completion_choice(index: int, out: Output, echo: str, with_echo: bool, with_logprobs: bool) -> dict:
    logprobs = completion_logprobs(_meta(out), with_echo, 0, 0, 0) if with_logprobs else None
    return _with_prefix_report({
        "index": index,
        "text": echo + out.get("text", ""),
        "logprobs": logprobs,
        "finish_reason": _openai_finish(out),
        "matched_stop": _matched_stop(out),
    }, out)  # fmt: skip


def _with_prefix_report(choice: dict[str, Any], out: Output) -> dict[str, Any]:
    """``choice`` plus the request's ``prefix_report`` when it asked for one (``return_prefix_report``)."""
    report = _meta(out).get("prefix_report")
    if report is not None:
        choice["prefix_report"] = report
    return choice


def completion_logprobs(
    meta: dict[str, Any], with_input: bool, skip: int, offset: int, skip_input: int
) -> dict[str, Any]:
    """OpenAI's completions logprobs from output triples ``[skip:]`` (and input triples when echoing).

    ``offset`` is the text offset of the first token reported.
    """
    triples: list[Any] = list((meta.get("input_token_logprobs") or [])[skip_input:]) if with_input else []
    tops: list[Any] = list((meta.get("input_top_logprobs") or [])[skip_input:]) if with_input else []
    tops += [None] * (len(triples) - len(tops))
    triples += (meta.get("output_token_logprobs") or [])[skip:]
    tops += (meta.get("output_top_logprobs") or [])[skip:]
    tokens = [t[2] or "" for t in triples]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [t[0] for t in triples],
        "top_logprobs": [{tt[2] or "": tt[0] for tt in row} if row else None for row in tops],
        "text_offset": offsets,
    }


@dataclass
class _StreamPos:
    text: int = 0
    logprobs: int = 0
    offset: int = 0
    started: bool = False
    finished: bool = False


async def _completion_chunks(
    run: RequestRun,
    tm: Any,
    ctx: _Ctx,
    echoes: list[str],
    echo: bool,
    with_logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    pos = [_StreamPos() for _ in echoes]
    last: list[Output] = [{} for _ in echoes]
    async for event in _events(run, tm, COMPLETION_NAMES):
        if isinstance(event, ApiError):
            yield sse.error_event(event)
            yield sse.DONE
            return
        index, out = event
        if out is None or pos[index].finished:
            continue
        out = last[index] = _present(out, ctx.texter)
        choice = _completion_delta(index, out, pos[index], echoes[index], echo, with_logprobs)
        if choice is not None:
            yield sse.event(_completion_chunk(ctx, [choice]))
    if include_usage:
        yield sse.event({**_completion_chunk(ctx, []), "usage": usage(last, ctx.n)})
    yield sse.DONE


def _chunk(ctx: _Ctx, kind: str, choices: list[dict]) -> dict[str, Any]:
    """One streamed object: ``kind`` is ``text_completion`` or ``chat.completion.chunk``."""
    return {"id": ctx.rid, "object": kind, "created": ctx.created, "model": ctx.model, "choices": choices}


def _completion_chunk(ctx: _Ctx, choices: list[dict]) -> dict[str, Any]:
    return _chunk(ctx, "text_completion", choices)


def _completion_delta(
    index: int, out: Output, pos: _StreamPos, echo_text: str, echo: bool, with_logprobs: bool
) -> dict | None:
    text = out.get("text", "")
    delta = text[pos.text :]
    reason = _openai_finish(out)
    first = not pos.started
    if not delta and reason is None and not first:
        return None
    meta = _meta(out)
    logprobs = None
    if with_logprobs:
        logprobs = completion_logprobs(meta, echo and first, pos.logprobs, pos.offset, 0)
        pos.offset += sum(len(t) for t in logprobs["tokens"])
        pos.logprobs = len(meta.get("output_token_logprobs") or [])
    pos.text, pos.started, pos.finished = len(text), True, reason is not None
    prefix = echo_text if echo and first else ""
    return {
        "index": index,
        "text": prefix + delta,
        "logprobs": logprobs,
        "finish_reason": reason,
        "matched_stop": _matched_stop(out) if reason else None,
    }


# ---- /v1/chat/completions ------------------------------------------------------------------------
def _content_text(content: str | list[dict[str, Any]] | None, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for k, part in enumerate(content):
        where = f"messages.{index}.content.{k}"
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type")
            raise ApiError(
                400, f"{where}: content part of type {kind!r} is not supported (text only)", param="messages"
            )
        texts.append(part["text"])
    return "".join(texts)


def _history_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            function["arguments"] = json.loads(args)
        except json.JSONDecodeError:
            pass
    return {**call, "type": call.get("type", "function"), "function": function}


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them (text content, tool-call arguments as objects)."""
    out = []
    for i, m in enumerate(messages):
        item: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": _content_text(m.content, i),
        }
        if m.name is not None:
            item["name"] = m.name
        if m.tool_calls:
            item["tool_calls"] = [_history_tool_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out


@dataclass
class _ChatTools:
    """Tools for the template, the parser (None: calls are not parsed), a forcing constraint, and
    the format that writes tools and earlier calls into templates without tool support."""

    tools: list[dict[str, Any]] | None = None
    parser: ToolCallParser | None = None
    structural_tag: str | None = None
    writer: ToolCallParser | None = None


def _chat_tools(body: ChatCompletionRequest, tm: Any) -> _ChatTools:
    choice = body.tool_choice
    if not body.tools:
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise ApiError(400, "tool_choice: forcing a call needs tools", param="tool_choice")
        has_calls = any(m.tool_calls for m in body.messages)
        return _ChatTools(writer=load_parser(tm.model_info) if has_calls else None)
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    parser = load_parser(tm.model_info)
    if parser is None:
        raise ApiError(400, "tools: tools are not supported by this server", param="tools")
    if choice == "none":
        return _ChatTools(tools, writer=parser)
    wire_choice = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
    try:
        tag = parser.constraint(tools, wire_choice, parallel=body.parallel_tool_calls is not False)
    except ValueError as exc:
        raise ApiError(400, f"tool_choice: {exc}", param="tool_choice") from None
    return _ChatTools(tools, parser, tag, writer=parser)


def _render_chat(tm: Any, body: ChatCompletionRequest, tools: _ChatTools) -> str:
    messages = template_messages(body.messages)
    if tools.writer is not None and not template_renders_tools(tm.tokenizer.chat_template):
        # With tool_choice "none" the tools are not described: the model is not to call them.
        messages = tools.writer.prompt_messages(messages, tools.tools if tools.parser else None)
    try:
        prompt = tm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools.tools)
    except ApiError:
        raise
    except Exception as exc:
        raise ApiError(400, f"messages: the chat template failed: {exc}", param="messages") from None
    return prompt


async def _chat_prompt_ids(tm: Any, prompt: str) -> list[int]:
    """The rendered chat's ids, encoded as every prompt is (off the loop, refused early when it
    cannot fit the context); the template already wrote any special tokens."""
    try:
        return await tm.encode_prompt(prompt, add_special_tokens=False)
    except InvalidRequest as exc:
        raise _api_error(exc, tm, CHAT_NAMES) from None


def _chat_wire(
    body: ChatCompletionRequest, prompt_len: int, context_len: int, tag: str | None
) -> dict[str, Any]:
    max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_new is None:
        max_new = max(context_len - prompt_len, 1)
    wire = sampling_wire(body, max_new)
    if tag is not None:
        wire["structural_tag"] = tag  # tool_choice "required" or a named function
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return wire
    if any(k in wire for k in ("json_schema", "regex", "ebnf", "structural_tag")):
        raise ApiError(
            400,
            "response_format: cannot be combined with json_schema, regex, ebnf or a forced tool call",
            param="response_format",
        )
    if fmt.type == "json_object":
        wire["json_schema"] = json.dumps({"type": "object"})
    elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ApiError(
            400, "response_format.json_schema.schema: required for type json_schema", param="response_format"
        )
    else:
        wire["json_schema"] = json.dumps(fmt.json_schema.schema_)
    return wire


def _chat_requests(
    body: ChatCompletionRequest, ids: list[int], tm: Any, rid: str, tag: str | None
) -> list[GenerateRequest]:
    n = _check_n(body.n)
    top = _check_top_logprobs(body.top_logprobs, "top_logprobs")
    if top and not body.logprobs:
        raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    wire = _chat_wire(body, len(ids), tm.context_len, tag)
    names = _chat_names(body)
    return [
        GenerateRequest(
            input_ids=list(ids),
            sampling_params=params,
            rid=f"{rid}-{j}",
            return_logprob=body.logprobs,
            top_logprobs_num=top,
            return_text_in_logprobs=True,
            stream=body.stream,
            return_prefix_report=body.return_prefix_report,
        )
        for j, params in enumerate(sampling_for_samples(wire, n, names=names))
    ]


def _chat_names(body: ChatCompletionRequest) -> dict[str, str]:
    if body.max_completion_tokens is None:
        return CHAT_NAMES
    return {**CHAT_NAMES, "max_new_tokens": "max_completion_tokens"}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    tm = get_tm(request)
    body = await parse_body(request, ChatCompletionRequest)
    await refuse_unknown_fields(request, body, tm)
    check_model(body.model, tm)
    require_serving(tm)
    tools = _chat_tools(body, tm)
    parser = tools.parser
    rid = _response_id("chatcmpl")
    ids = await _chat_prompt_ids(tm, _render_chat(tm, body, tools))
    reqs = _chat_requests(body, ids, tm, rid, tools.structural_tag)
    run = RequestRun(tm, reqs, request)
    ctx = _Ctx(rid, int(time.time()), served_model_name(tm), body.n, token_texter(tm.tokenizer))
    if body.stream:
        if not await _prime(run, tm, _chat_names(body)):
            return Response(status_code=499)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        streams = [parser.streaming() if parser else None for _ in reqs]
        return sse.response(_chat_chunks(run, tm, ctx, streams, body.logprobs, include_usage))
    outs = await _finals(run, tm, _chat_names(body))
    if outs is None:
        return Response(status_code=499)
    outs = [_present(o, ctx.texter) for o in outs]
    choices = [_chat_choice(i, o, parser, body.logprobs) for i, o in enumerate(outs)]
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": ctx.created,
            "model": ctx.model,
            "choices": choices,
            "usage": usage(outs, body.n),
        }
    )


def _chat_choice(
    index: int, out: Output, parser: ToolCallParser | None, with_logprobs: bool
) -> dict[str, Any]:
    text = out.get("text", "")
    calls: list[dict[str, Any]] = []
    if parser is not None:
        text, calls = parser.parse(text)
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    logprobs = {"content": chat_logprobs(_meta(out), 0)} if with_logprobs else None
    reason = _openai_finish(out)
    if calls and reason == "stop":  # a response cut at max_tokens stays "length"
        reason = "tool_calls"
    return _with_prefix_report({
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": reason,
        "matched_stop": _matched_stop(out),
    }, out)  # fmt: skip


def _token_entry(triple: Sequence[Any]) -> dict[str, Any]:
    token = triple[2] or ""
    return {"token": token, "logprob": triple[0], "bytes": list(token.encode("utf-8"))}


def chat_logprobs(meta: dict[str, Any], skip: int) -> list[dict[str, Any]]:
    """OpenAI chat ``logprobs.content`` for output tokens ``[skip:]``."""
    triples = (meta.get("output_token_logprobs") or [])[skip:]
    tops = (meta.get("output_top_logprobs") or [])[skip:]
    entries = []
    for k, triple in enumerate(triples):
        row = tops[k] if k < len(tops) else None
        entries.append({**_token_entry(triple), "top_logprobs": [_token_entry(t) for t in row or ()]})
    return entries


@dataclass
class _ChatPos:
    text: int = 0
    logprobs: int = 0
    started: bool = False
    finished: bool = False
    tools: StreamingToolCalls | None = None


async def _chat_chunks(
    run: RequestRun,
    tm: Any,
    ctx: _Ctx,
    streams: list[StreamingToolCalls | None],
    with_logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    pos = [_ChatPos(tools=s) for s in streams]
    last: list[Output] = [{} for _ in streams]
    async for event in _events(run, tm, CHAT_NAMES):
        if isinstance(event, ApiError):
            yield sse.error_event(event)
            yield sse.DONE
            return
        index, out = event
        if out is None or pos[index].finished:
            continue
        out = last[index] = _present(out, ctx.texter)
        for choice in _chat_deltas(index, out, pos[index], with_logprobs):
            yield sse.event(_chat_chunk(ctx, [choice]))
    if include_usage:
        yield sse.event({**_chat_chunk(ctx, []), "usage": usage(last, ctx.n)})
    yield sse.DONE


def _chat_chunk(ctx: _Ctx, choices: list[dict]) -> dict[str, Any]:
    return _chunk(ctx, "chat.completion.chunk", choices)


def _chat_deltas(index: int, out: Output, pos: _ChatPos, with_logprobs: bool) -> list[dict[str, Any]]:
    """The chunks' choices for one new output of choice ``index`` (role first, finish last)."""
    choices = []
    if not pos.started:
        pos.started = True
        choices.append(_chat_delta(index, {"role": "assistant", "content": ""}))
    text = out.get("text", "")
    delta, pos.text = text[pos.text :], len(text)
    meta = _meta(out)
    logprobs = None
    if with_logprobs:
        logprobs = {"content": chat_logprobs(meta, pos.logprobs)}
        pos.logprobs = len(meta.get("output_token_logprobs") or [])
    reason = _openai_finish(out)
    choices += _text_and_calls(index, delta, pos, logprobs, reason is not None)
    if reason is not None:
        pos.finished = True
        called = pos.tools is not None and pos.tools.num_calls > 0
        final = _chat_delta(index, {}, finish="tool_calls" if called and reason == "stop" else reason)
        final["matched_stop"] = _matched_stop(out)
        choices.append(final)
    return choices


def _text_and_calls(
    index: int, delta: str, pos: _ChatPos, logprobs: dict | None, finished: bool
) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    if pos.tools is not None:
        delta, calls = pos.tools.feed(delta)
        if finished:
            rest, more = pos.tools.finish()
            delta, calls = delta + rest, calls + more
    choices = []
    if delta or logprobs and logprobs["content"]:
        choice = _chat_delta(index, {"content": delta})
        choice["logprobs"] = logprobs
        choices.append(choice)
    for call in calls:
        choices.append(_chat_delta(index, {"tool_calls": [call]}))
    return choices


def _chat_delta(index: int, delta: dict[str, Any], *, finish: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
