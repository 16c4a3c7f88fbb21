"""Runs the engine requests behind one HTTP request.

One HTTP request may carry several engine requests (a batch, ``n > 1``). ``RequestRun`` iterates
``tm.generate`` for each of them in its own task and hands their outputs to the route in arrival
order. Closing the run (error, client disconnect, finished stream) cancels every task, and the
tokenizer manager aborts a request whose iteration is cancelled, so nothing keeps running for a
client that is gone.

Outputs are SGLang-shaped dicts: cumulative ``text`` / ``output_ids`` and ``meta_info``.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from phloem.runtime.sampling.params import PREFIX as SAMPLING_PREFIX
from phloem.runtime.server.http_errors import ApiError
from phloem.runtime.tokenizer.request import GenerateRequest
from starlette.requests import Request

DISCONNECT_POLL_S = 0.5
# After the engine starts shutting down (or breaks), requests still waiting this long get a 503,
# so clients see an error before the server's drain period ends and it drops connections.
ENGINE_DOWN_GRACE_S = 2.0

Output = dict[str, Any]
Event = tuple[int, Output | None]  # (index, output); output None: that request is done


class ClientDisconnected(Exception):
    """The HTTP client went away; the run has been closed."""


class RequestRun:
    """Concurrent iteration of ``tm.generate`` for several requests of one HTTP request."""

    def __init__(
        self,
        tm: Any,
        reqs: Sequence[GenerateRequest],
        request: Request | None = None,
        *,
        poll_s: float = DISCONNECT_POLL_S,
    ) -> None:
        self._tm = tm
        self._request = request
        self._poll_s = poll_s
        self._queue: asyncio.Queue[tuple[int, Output | None, BaseException | None]] = asyncio.Queue()
        self._tasks = [asyncio.ensure_future(self._pump(i, r)) for i, r in enumerate(reqs)]
        self._getter: asyncio.Future | None = None
        self._buffer: deque[Event] = deque()
        self._down_since: float | None = None
        self.size = len(reqs)

    async def _pump(self, index: int, req: GenerateRequest) -> None:
        try:
            async for out in self._tm.generate(req):
                self._queue.put_nowait((index, out, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reported to the route, which picks the HTTP status
            self._queue.put_nowait((index, None, exc))
            return
        self._queue.put_nowait((index, None, None))

    async def _next_raw(self) -> Event:
        """The next event; raises a request's exception, or ``ClientDisconnected``."""
        while True:
            if self._getter is None:
                self._getter = asyncio.ensure_future(self._queue.get())
            done, _ = await asyncio.wait({self._getter}, timeout=self._poll_s)
            if not done:
                self._check_engine()
                if self._request is not None and await self._request.is_disconnected():
                    self.close()
                    raise ClientDisconnected()
                continue
            index, out, exc = self._getter.result()
            self._getter = None
            if exc is not None:
                raise exc
            return index, out

    def _check_engine(self) -> None:
        """Give up (503) once the engine has been shutting down or broken for a grace period."""
        state = self._tm.health()
        if state not in ("shutting_down", "broken"):
            return
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
        elif now - self._down_since >= ENGINE_DOWN_GRACE_S:
            self.close()
            raise ApiError(503, f"server is {state.replace('_', ' ')}")

    async def next_event(self) -> Event:
        if self._buffer:
            return self._buffer.popleft()
        return await self._next_raw()

    async def prime(self, names: dict[str, str] | None = None) -> None:
        """Wait until every request has produced something (or raised), before any byte is sent.

        Request errors found at tokenization, or by the engine before the first token (a grammar
        that does not compile: an abort with a 4xx status), then become a proper HTTP 4xx instead
        of an error event inside a 200 stream. ``names``: as for :func:`abort_error`.
        """
        seen: set[int] = set()
        while len(seen) < self.size:
            event = await self._next_raw()
            self._buffer.append(event)
            seen.add(event[0])
        for _, out in self._buffer:
            err = abort_error(out, "serving", names) if out is not None else None
            if err is not None and 400 <= err.status < 500:
                raise err

    async def events(self) -> AsyncIterator[Event]:
        """Every output until all requests are done (the end-of-request ``None`` events included)."""
        remaining = self.size
        while remaining:
            event = await self.next_event()
            if event[1] is None:
                remaining -= 1
            yield event

    async def finals(self) -> list[Output]:
        """The last output of every request, in request order."""
        last: list[Output | None] = [None] * self.size
        async for index, out in self.events():
            if out is not None:
                last[index] = out
        missing = [i for i, out in enumerate(last) if out is None]
        if missing:
            raise ApiError(500, f"the engine returned no output for request {missing[0]}")
        return [out for out in last if out is not None]

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._getter is not None:
            self._getter.cancel()
            self._getter = None


# ---- finish reasons ------------------------------------------------------------------------------
def finish_reason(out: Output) -> dict[str, Any] | None:
    return (out.get("meta_info") or {}).get("finish_reason")


def openai_param(field: str, names: dict[str, str]) -> str:
    """``sampling_params.max_new_tokens[0]`` -> ``max_tokens[0]`` given ``{"max_new_tokens": "max_tokens"}``."""
    rest = field.removeprefix(f"{SAMPLING_PREFIX}.")
    base = re.split(r"[.\[]", rest, maxsplit=1)[0]
    return names.get(base, base) + rest[len(base) :]


def abort_error(out: Output, health: str, names: dict[str, str] | None = None) -> ApiError | None:
    """The HTTP error for an aborted request, or None if ``out`` is an answer to send as it is.

    An abort the caller asked for (``/abort_request``, ``Engine.abort``) carries no status: its
    output is an answer like any other, whose ``finish_reason`` is ``{"type": "abort", ...}``
    (SGLang's contract: HTTP 200, and a stream's last chunk carries that reason). An abort with a
    status is an error: 4xx for a request the engine could not serve (a grammar that does not
    compile), 5xx for an engine failure (503 while the server shuts down or is broken; an
    unusable status becomes 500, or 503 in those states). The error carries the finish reason, and
    where the engine names the field at fault (``param``, a native name such as
    ``sampling_params.regex``) it names it too, as the client's field given ``names`` (the OpenAI
    routes' wire name -> client name, :func:`openai_param`).
    """
    reason = finish_reason(out)
    if not reason or reason.get("type") != "abort":
        return None
    status = reason.get("status_code")
    if status is None:
        return None
    message = str(reason.get("message") or "request aborted")
    if not isinstance(status, int) or not 400 <= status < 600:
        status = 503 if health in ("shutting_down", "broken") else 500
    param = reason.get("param")
    if not isinstance(param, str) or not param:
        return ApiError(status, message, finish_reason=reason)
    if names is not None:
        param = openai_param(param, names)
    return ApiError(status, f"{param}: {message}", param=param, finish_reason=reason)


def raise_if_aborted(outs: Sequence[Output], health: str, names: dict[str, str] | None = None) -> None:
    for out in outs:
        err = abort_error(out, health, names)
        if err is not None:
            raise err


# ---- logprob texts -------------------------------------------------------------------------------
TRIPLE_KEYS = ("input_token_logprobs", "output_token_logprobs")
TRIPLE_LIST_KEYS = (
    "input_top_logprobs",
    "output_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_ids_logprobs",
)


def token_texter(tokenizer: Any) -> Callable[[int], str]:
    """``token_id -> text`` for logprob triples, memoized for one response."""
    cache: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return cache[token_id]

    return text


LOGPROB_FLOOR = -9999.0  # -inf (a token the grammar masked) is not valid JSON


def _logprob(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else LOGPROB_FLOOR


def _fill_triple(triple: Sequence[Any], text: Callable[[int], str] | None) -> list[Any]:
    logprob, token_id = triple[0], triple[1]
    known = triple[2] if len(triple) > 2 else None
    if known is None and text is not None:
        known = text(int(token_id))
    return [_logprob(logprob), token_id, known]


def process_logprobs(meta: dict[str, Any], text: Callable[[int], str] | None) -> None:
    """Clamp -inf logprobs and, when ``text`` is given, fill missing token texts in the triples.

    Writes new lists into ``meta``; the engine's lists are left untouched.
    """
    for key in TRIPLE_KEYS:
        if meta.get(key):
            meta[key] = [_fill_triple(t, text) for t in meta[key]]
    for key in TRIPLE_LIST_KEYS:
        if meta.get(key):
            meta[key] = [None if row is None else [_fill_triple(t, text) for t in row] for row in meta[key]]
