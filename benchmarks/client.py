"""Backends that send one benchmark request and time it: phloem's ``/generate``, OpenAI routes, Engine.

Every backend streams, so time to first token and the gaps between tokens are measured on the
client. A request succeeds only when the server answered 200, sent no error event, did not abort,
and produced output (text, or output tokens it counted); everything else is a failure with a message.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

SSE_PREFIX = "data:"
SSE_DONE = "[DONE]"


@dataclass(frozen=True)
class Prepared:
    """A request ready to send: ``text`` is always the rendered prompt; ``messages`` only for chats."""

    sid: int
    turn: int
    text: str
    output_len: int
    prompt_len: int  # counted by the client's tokenizer
    messages: list[dict[str, str]] | None = None
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    ignore_eos: bool = True


@dataclass
class Result:
    """What happened to one request; times in seconds (``start`` on ``time.perf_counter``)."""

    sid: int
    turn: int
    prompt_len: int
    output_len: int
    success: bool = False
    error: str = ""
    text: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    server_prompt_tokens: int | None = None
    server_output_tokens: int | None = None
    cached_tokens: int | None = None
    client_output_tokens: int = 0
    finish_reason: Any = None
    prefix_report: dict[str, Any] | None = None  # meta_info.prefix_report, when asked for

    def fail(self, message: str) -> Result:
        self.success, self.error = False, message
        return self

    def to_record(self) -> dict[str, Any]:
        """JSON-friendly copy (the generated text is kept; ITL lists are long, so rounded)."""
        out = dict(self.__dict__)
        out["itl"] = [round(x, 6) for x in self.itl]
        return out


class Backend(Protocol):
    async def send(self, req: Prepared) -> Result: ...

    async def close(self) -> None: ...


class StreamClock:
    """Turns token arrivals into TTFT and inter-token gaps (a chunk of ``k`` tokens adds ``k`` gaps)."""

    def __init__(self, result: Result) -> None:
        self.result = result
        self.start = result.start = time.perf_counter()
        self.last = self.start

    def tokens(self, k: int) -> None:
        if k <= 0:
            return
        now = time.perf_counter()
        if not self.result.ttft:
            self.result.ttft = now - self.start
            k -= 1
        if k > 0:
            self.result.itl += [(now - self.last) / k] * k
        self.last = now

    def finish(self) -> None:
        self.result.latency = time.perf_counter() - self.start


async def sse_events(content: Any) -> AsyncIterator[dict[str, Any]]:
    """JSON payloads of a ``data: ...`` event stream, up to ``[DONE]`` (aiohttp ``StreamReader``)."""
    async for raw in content:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith(SSE_PREFIX):
            continue
        data = line[len(SSE_PREFIX) :].strip()
        if data == SSE_DONE:
            return
        yield json.loads(data)


def error_message(payload: Any) -> str | None:
    """The error of an error body or event (``{"error": {"message": ...}}`` or a plain string)."""
    if not isinstance(payload, dict) or "error" not in payload:
        return None
    err = payload["error"]
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


def abort_message(finish_reason: Any) -> str | None:
    if isinstance(finish_reason, dict) and finish_reason.get("type") == "abort":
        return f"aborted: {finish_reason.get('message')}"
    return None


def check_output(result: Result) -> Result:
    """Marks a finished request successful unless it aborted or came back empty."""
    aborted = abort_message(result.finish_reason)
    if aborted:
        return result.fail(aborted)
    if result.output_len > 0 and not result.text and not result.server_output_tokens:
        return result.fail("empty response: no text and no output tokens")
    result.success = True
    return result


# ---- HTTP backends ---------------------------------------------------------------------------------
class HttpBackend:
    """Shared aiohttp session and error handling; subclasses build the body and read the stream."""

    def __init__(
        self, base_url: str, *, model: str | None = None, api_key: str | None = None, prefix_report: bool = False
    ) -> None:
        import aiohttp

        self.prefix_report = prefix_report  # ask for meta_info.prefix_report (phloem's routes)
        self.base_url = base_url.rstrip("/")
        self.model = model or "default"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = aiohttp.ClientTimeout(total=6 * 3600)
        # A fresh connection per request: a pooled keep-alive connection that the server has just
        # closed (llama.cpp's server does this) would otherwise fail the next request sent on it.
        connector = aiohttp.TCPConnector(force_close=True)
        self.session = aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector)

    async def close(self) -> None:
        await self.session.close()

    def route(self, req: Prepared) -> str:
        raise NotImplementedError

    def body(self, req: Prepared) -> dict[str, Any]:
        raise NotImplementedError

    def on_event(self, event: dict[str, Any], clock: StreamClock, result: Result) -> None:
        raise NotImplementedError

    async def send(self, req: Prepared) -> Result:
        result = Result(req.sid, req.turn, req.prompt_len, req.output_len)
        clock = StreamClock(result)
        try:
            async with self.session.post(self.base_url + self.route(req), json=self.body(req)) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    return result.fail(f"HTTP {resp.status}: {text[:300]}")
                async for event in sse_events(resp.content):
                    message = error_message(event)
                    if message is not None:
                        return result.fail(f"error event: {message}")
                    self.on_event(event, clock, result)
        except Exception as exc:  # connection reset, bad JSON, timeouts: all failures
            return result.fail(f"{type(exc).__name__}: {exc}")
        clock.finish()
        return check_output(result)


class PhloemBackend(HttpBackend):
    """SGLang-native ``POST /generate`` with ``stream``: cumulative text and ``meta_info`` per chunk."""

    def route(self, req: Prepared) -> str:
        return "/generate"

    def body(self, req: Prepared) -> dict[str, Any]:
        body = {"text": req.text, "sampling_params": sampling_params(req), "stream": True}
        if self.prefix_report:
            body["return_prefix_report"] = True
        return body

    def on_event(self, event: dict[str, Any], clock: StreamClock, result: Result) -> None:
        apply_native_chunk(event, clock, result)


def sampling_params(req: Prepared) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": req.output_len, "temperature": 0.0}
    if req.ignore_eos:
        params["ignore_eos"] = True
    if req.json_schema is not None:
        params["json_schema"] = json.dumps(req.json_schema)
    if req.regex is not None:
        params["regex"] = req.regex
    return params


def apply_native_chunk(chunk: dict[str, Any], clock: StreamClock, result: Result) -> None:
    """One cumulative chunk of ``/generate`` (or the Engine): new tokens, counts, finish reason."""
    meta = chunk.get("meta_info") or {}
    done = meta.get("completion_tokens")
    before = result.server_output_tokens or 0
    new = (done - before) if done is not None else int(chunk.get("text", "") != result.text)
    clock.tokens(new)
    result.text = chunk.get("text", result.text)
    if done is not None:
        result.server_output_tokens = done
    result.server_prompt_tokens = meta.get("prompt_tokens", result.server_prompt_tokens)
    result.cached_tokens = meta.get("cached_tokens", result.cached_tokens)
    result.finish_reason = meta.get("finish_reason") or result.finish_reason
    result.prefix_report = meta.get("prefix_report", result.prefix_report)


class OpenAIBackend(HttpBackend):
    """``/v1/chat/completions`` for chat sessions, ``/v1/completions`` for raw prompts; streamed deltas."""

    def route(self, req: Prepared) -> str:
        return "/v1/chat/completions" if req.messages is not None else "/v1/completions"

    def body(self, req: Prepared) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": req.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if req.ignore_eos:
            body["ignore_eos"] = True
        if req.messages is not None:
            body["messages"] = req.messages
        else:
            body["prompt"] = req.text
        if req.json_schema is not None:
            body |= json_format(req)
        if req.regex is not None:
            body["regex"] = req.regex  # SGLang's extra field, which ours and llama.cpp's accept too
        return body

    def on_event(self, event: dict[str, Any], clock: StreamClock, result: Result) -> None:
        for choice in event.get("choices") or []:
            delta = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
            if delta:
                clock.tokens(1)
                result.text += delta
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        usage = event.get("usage")
        if usage:
            result.server_prompt_tokens = usage.get("prompt_tokens")
            result.server_output_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens")


def json_format(req: Prepared) -> dict[str, Any]:
    """Chat: OpenAI's ``response_format``; completions (no such field in OpenAI's API): ``json_schema``,
    which SGLang, llama.cpp's server and ours accept."""
    if req.messages is None:
        return {"json_schema": req.json_schema}
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "extraction", "schema": req.json_schema},
        }
    }


# ---- in-process Engine -----------------------------------------------------------------------------
class EngineBackend:
    """Sends requests to an in-process ``phloem.Engine`` (``async_generate``, streamed)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def close(self) -> None:
        return None

    async def send(self, req: Prepared) -> Result:
        result = Result(req.sid, req.turn, req.prompt_len, req.output_len)
        clock = StreamClock(result)
        try:
            stream = await self.engine.async_generate(
                req.text, sampling_params=sampling_params(req), stream=True
            )
            async for chunk in stream:
                apply_native_chunk(chunk, clock, result)
        except Exception as exc:
            return result.fail(f"{type(exc).__name__}: {exc}")
        clock.finish()
        return check_output(result)


BACKENDS: dict[str, type[HttpBackend]] = {"phloem": PhloemBackend, "openai": OpenAIBackend}
