"""Forwarding requests to workers: one routed request (retried once), or one call to each worker.

A request that fails before any byte of the answer arrived (refused or dropped connection) is sent
once more, to another worker when there is one: nothing was generated for the client yet. Once an
answer started, a failure is the client's: a buffered answer becomes a 502 naming the worker, a
stream ends with an SSE error event naming it (the client has already read part of the stream).
A client that leaves before its answer closes the router's connection to the worker, so the worker
stops generating for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any, TypeVar

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from phloem.runtime.router.metrics import RouterMetrics
from phloem.runtime.router.pool import NoHealthyWorker, WorkerPool
from phloem.runtime.router.request_text import estimate_tokens, request_texts
from phloem.runtime.router.worker import Worker
from phloem.runtime.server import sse
from phloem.runtime.server.http_errors import ApiError

logger = logging.getLogger("phloem.router")
T = TypeVar("T")

WORKER_HEADER = "x-phloem-worker"  # on every routed answer: which worker produced it
_PASSED_REQUEST_HEADERS = ("content-type", "accept", "authorization")
_PASSED_RESPONSE_HEADERS = ("content-type", "cache-control", "x-accel-buffering", "www-authenticate")
_ATTEMPTS = 2


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Proxy:
    def __init__(
        self, pool: WorkerPool, metrics: RouterMetrics, session: aiohttp.ClientSession, api_key: str | None
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.session = session
        self.api_key = api_key

    def _headers(self, request: Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k in _PASSED_REQUEST_HEADERS}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        return headers

    def no_worker(self, route: str, why: str = "") -> ApiError:
        self.metrics.no_worker.inc()
        self.metrics.errors.labels(route).inc()
        n = len(self.pool.workers)
        return ApiError(503, f"no healthy worker: all {n} workers are out{why} (see GET /workers)")

    async def forward(self, request: Request, route: str, *, routed: bool = True) -> Response:
        """Send the request to one worker picked by the policy (``routed``: by its prompt text)."""
        self.metrics.requests.labels(route).inc()
        body = await request.body()
        parsed: Any = None
        if routed and body:
            try:
                parsed = json.loads(body)
            except ValueError:
                pass  # the worker answers the bad body with its 400
        texts = request_texts(route, parsed)
        tokens = estimate_tokens(parsed, texts)
        url_path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = self._headers(request)
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            return await self._forward(request, route, url_path, body, headers, texts, tokens, gone)
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the worker saw its connection close
        finally:
            gone.cancel()  # a relayed stream's own disconnect watch takes over

    async def _forward(
        self, request: Request, route: str, url_path: str, body: bytes, headers: dict[str, str],
        texts: list[str], tokens: int, gone: asyncio.Future,
    ) -> Response:  # fmt: skip
        tried: list[Worker] = []
        last_failure = ""
        for _ in range(_ATTEMPTS):
            try:
                choice = self.pool.route(texts, tokens, exclude=tried)
            except NoHealthyWorker:
                if tried and tried[-1].healthy:  # the only worker dropped one connection: once more there
                    choice = self.pool.route(texts, tokens)
                else:
                    raise self.no_worker(route, f" ({last_failure})" if last_failure else "") from None
            w = choice.worker
            try:
                sent = self.session.request(request.method, w.url + url_path, data=body, headers=headers)
                resp = await _unless_gone(sent, gone)
            except _ClientGone:
                self.pool.done(w, tokens)
                raise
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                self.pool.done(w, tokens)
                refused = isinstance(exc, aiohttp.ClientConnectorError)
                last_failure = f"worker {w.url}: {_reason(exc)}"
                self.pool.failed(w, _reason(exc), unreachable=refused)
                self.metrics.retries.inc()
                logger.warning("%s %s: worker %s failed before answering (%s); retrying", request.method,
                               route, w.url, _reason(exc))  # fmt: skip
                tried.append(w)
                continue
            return await self._answer(resp, w, tokens, route, gone)
        self.metrics.errors.labels(route).inc()
        raise ApiError(502, f"{last_failure} (tried {len(tried)} workers)")

    async def _answer(
        self, resp: aiohttp.ClientResponse, w: Worker, tokens: int, route: str, gone: asyncio.Future
    ) -> Response:
        headers = {k: v for k, v in resp.headers.items() if k.lower() in _PASSED_RESPONSE_HEADERS}
        headers[WORKER_HEADER] = w.url
        if resp.status >= 500:
            self.pool.failed(w, f"answered {resp.status}", unreachable=False)
            self.metrics.errors.labels(route).inc()
        if resp.content_type == "text/event-stream":
            return StreamingResponse(
                self._relay(resp, w, tokens, route), status_code=resp.status, headers=headers
            )
        read = False
        try:
            data = await _unless_gone(resp.read(), gone)
            read = True
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.pool.failed(w, _reason(exc), unreachable=False)
            self.metrics.errors.labels(route).inc()
            raise ApiError(502, f"worker {w.url} failed while answering: {_reason(exc)}") from None
        finally:
            if read:
                resp.release()  # the connection goes back to the pool
            else:
                resp.close()
            self.pool.done(w, tokens)
        return Response(data, status_code=resp.status, headers=headers)

    async def _relay(
        self, resp: aiohttp.ClientResponse, w: Worker, tokens: int, route: str
    ) -> AsyncIterator[bytes]:
        """Pass a worker's SSE stream through chunk by chunk, as it arrives."""
        last = b""
        complete = False
        try:
            async for chunk in resp.content.iter_any():
                last = chunk
                yield chunk
            complete = True
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.pool.failed(w, _reason(exc), unreachable=False)
            self.metrics.errors.labels(route).inc()
            logger.warning("%s: worker %s failed mid-stream (%s)", route, w.url, _reason(exc))
            cut = b"" if not last or last.endswith(b"\n\n") else b"\n\n"  # end a half-sent event first
            err = ApiError(502, f"worker {w.url} failed mid-stream: {_reason(exc)}")
            yield cut + sse.error_event(err) + sse.DONE
        finally:
            if complete:
                resp.release()  # the connection goes back to the pool
            else:
                resp.close()  # the client left (or the worker failed): the worker sees the disconnect
            self.pool.done(w, tokens)

    async def fan_out(self, request: Request, route: str) -> list[tuple[Worker, int, Any]]:
        """The request sent to every healthy worker at once: (worker, status, JSON answer or error)."""
        self.metrics.requests.labels(route).inc()
        workers = self.pool.healthy()
        if not workers:
            raise self.no_worker(route)
        body = await request.body()
        url_path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = self._headers(request)

        async def one(w: Worker) -> tuple[Worker, int, Any]:
            try:
                async with self.session.request(
                    request.method, w.url + url_path, data=body, headers=headers
                ) as r:
                    data = await r.read()
                    try:
                        return w, r.status, json.loads(data)
                    except ValueError:
                        return w, r.status, data.decode(errors="replace")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self.pool.failed(w, _reason(exc), unreachable=isinstance(exc, aiohttp.ClientConnectorError))
                return w, 502, {"error": {"message": f"worker {w.url}: {_reason(exc)}", "code": 502}}

        return list(await asyncio.gather(*(one(w) for w in workers)))


class _ClientGone(Exception):
    pass


async def _disconnect(request: Request) -> None:
    """Returns when the client closes its connection (the body was read already: the next ASGI
    message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(work: Awaitable[T], gone: asyncio.Future) -> T:
    """``await work``, unless the client leaves first: then ``work`` is cancelled (its connection
    to the worker closes, so the worker stops generating) and ``_ClientGone`` raised."""
    task = asyncio.ensure_future(work)
    await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise _ClientGone


def merged_status(results: list[tuple[Worker, int, Mapping[str, Any] | Any]]) -> int:
    """200 when every worker answered 200, else the first other status."""
    return next((status for _, status, _ in results if status != 200), 200)
