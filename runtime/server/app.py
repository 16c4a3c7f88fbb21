"""The HTTP server: FastAPI app over a TokenizerManager, and the uvicorn process around it.

``create_app(tm)`` builds the ASGI app (routes in ``native.py``, ``openai_api.py``,
``tool_routes.py``, ``weight_routes.py``, ``rl_routes.py`` and ``debug_routes.py``).
``run_server(args)`` starts the engine, serves until SIGTERM/SIGINT (in-flight requests get an
abort error, the server drains for a few seconds) or until the engine breaks (a child process
died, or the scheduler was silent for ``--watchdog-timeout``: the server exits non-zero within
seconds, its children killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import secrets
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from phloem.runtime.config import EngineArgs
from phloem.runtime.metrics import ServerMetrics
from phloem.runtime.server import debug_routes, native, openai_api, rl_routes, tool_routes, weight_routes
from phloem.runtime.server.http_errors import ApiError, install_error_handlers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("phloem.server")

PUBLIC_PATHS = frozenset({"/health", "/metrics"})
DRAIN_S = 5
WATCHDOG_INTERVAL_S = 0.25
SHUTDOWN_TIMEOUT_S = 10.0
CHILD_EXIT_TIMEOUT_S = 2.0  # per child, after the engine was told to shut down

TmFactory = Callable[[EngineArgs], Any]


# ---- app -----------------------------------------------------------------------------------------
def create_app(tm: Any) -> FastAPI:
    """The ASGI app serving ``tm``; attaches a ``ServerMetrics`` to ``tm.metrics`` if it has none."""
    from phloem import __version__

    if getattr(tm, "metrics", None) is None:
        prefix = getattr(getattr(tm, "args", None), "metrics_prefix", "phloem")
        tm.metrics = ServerMetrics(native.served_model_name(tm), prefix=prefix)
        if hasattr(tm, "heartbeat_age"):
            tm.metrics.watch_heartbeat(tm.heartbeat_age)
    app = FastAPI(title="phloem", version=__version__, redoc_url=None)
    app.state.tm = tm
    install_error_handlers(app)
    app.include_router(native.router)
    app.include_router(openai_api.router)
    app.include_router(tool_routes.router)
    app.include_router(weight_routes.router)
    app.include_router(rl_routes.router)
    app.include_router(debug_routes.router)
    # Added last = outermost: auth runs before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=tm.args.max_request_body_bytes)
    if tm.args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=tm.args.api_key)
    return app


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on every route but ``PUBLIC_PATHS``; 401 otherwise."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        err = ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')")
        response = err.response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return secrets.compare_digest(value, self._expected)
        return False


class BodyLimitMiddleware:
    """Reads the whole body first; more than ``max_bytes`` is a 413 before any route runs."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        body = await self._read(receive)
        if body is None:
            await self._reject(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = ApiError(413, f"request body is larger than {self.max_bytes} bytes")
        await err.response()(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls only ever see http.disconnect

    return replay


# ---- process -------------------------------------------------------------------------------------
class _Server(uvicorn.Server):
    """uvicorn, plus: a signal starts the engine's shutdown; signals are not re-raised on exit."""

    def __init__(self, config: uvicorn.Config, tm: Any) -> None:
        super().__init__(config)
        self.tm = tm
        self.broken = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit and self._loop is not None:
            logger.info("received %s: shutting down", signal.Signals(sig).name)
            self._loop.call_soon_threadsafe(self.tm.start_shutdown)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def check_port_free(host: str, port: int) -> None:
    """Raise ``ValueError`` naming ``--port`` when ``host:port`` cannot be bound (in use, or not an
    address of this machine); port 0 (any free port) always passes."""
    import socket

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror or exc})") from None


async def _watchdog(server: _Server, tm: Any) -> None:
    """Stop the server at once when the engine breaks (a child process died, or the scheduler sent
    no heartbeat for ``--watchdog-timeout``: ``launch._watchdog``)."""
    while not server.should_exit:
        if tm.health() == "broken":
            logger.error("engine is broken; stopping the server")
            server.broken = True
            server.should_exit = server.force_exit = True
            return
        await asyncio.sleep(WATCHDOG_INTERVAL_S)


async def _announce(server: _Server, host: str) -> None:
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1] if server.servers else server.config.port
    shown = f"[{host}]" if ":" in host else host
    print(f"phloem serving at http://{shown}:{port}", flush=True)


async def _start_engine(args: EngineArgs, tm_factory: TmFactory | None) -> tuple[Any, Callable[[], None]]:
    """(tm, cleanup). A factory may return the tm, an awaitable of it, or ``(tm, cleanup)``."""
    if tm_factory is None:
        from phloem.runtime.launch import launch_engine

        tm, procs = await launch_engine(args)
        return tm, lambda: procs.terminate(timeout=CHILD_EXIT_TIMEOUT_S)
    made = tm_factory(args)
    if inspect.isawaitable(made):
        made = await made
    if isinstance(made, tuple):
        return made[0], made[1]
    return made, lambda: None


async def _stop_engine(tm: Any, cleanup: Callable[[], None]) -> None:
    shutdown = getattr(tm, "shutdown", None)
    if shutdown is not None:
        try:
            result = shutdown()
            if inspect.isawaitable(result):
                await asyncio.wait_for(result, SHUTDOWN_TIMEOUT_S)
        except Exception:
            logger.exception("engine shutdown failed")
    await asyncio.to_thread(cleanup)


async def serve(args: EngineArgs, tm_factory: TmFactory | None = None) -> int:
    """Serve until a signal (exit code 0) or until the engine breaks (exit code 1)."""
    check_port_free(args.host, args.port)  # before the model loads, not after
    tm, cleanup = await _start_engine(args, tm_factory)
    config = uvicorn.Config(
        create_app(tm),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="off",
        log_level=args.log_level,
        access_log=args.log_requests,
        timeout_graceful_shutdown=DRAIN_S,
    )
    server = _Server(config, tm)
    helpers = [asyncio.create_task(_watchdog(server, tm)), asyncio.create_task(_announce(server, args.host))]
    try:
        await server.serve()
    finally:
        for task in helpers:
            task.cancel()
        await _stop_engine(tm, cleanup)
    return 1 if server.broken else 0


def run_server(args: EngineArgs, tm_factory: TmFactory | None = None) -> int:
    """Run the server in this process on uvloop; returns the exit code.

    ``tm_factory(args)`` builds the TokenizerManager on the server's event loop (default: launch the
    engine processes with ``launch_engine``).
    """
    import uvloop

    code = uvloop.run(serve(args, tm_factory))
    if code:
        logger.error("server exiting with code %d", code)
    sys.stdout.flush()
    return code
