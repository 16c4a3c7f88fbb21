"""The router's HTTP app and the process around it (``phloem router``).

Routes: ``/generate``, ``/v1/completions`` and ``/v1/chat/completions`` go to one worker picked by
the policy (streams relayed as they arrive); ``/v1/models``, model info and tokenizer routes go to
any healthy worker; ``/flush_cache`` and ``/get_server_info`` go to every healthy worker;
``/health``, ``/metrics`` and ``/workers`` are the router's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from phloem.runtime.router.config import RouterArgs
from phloem.runtime.router.metrics import CONTENT_TYPE, RouterMetrics
from phloem.runtime.router.policy import make_policy
from phloem.runtime.router.pool import WorkerPool
from phloem.runtime.router.proxy import Proxy, merged_status
from phloem.runtime.server.app import ApiKeyMiddleware, check_port_free
from phloem.runtime.server.http_errors import install_error_handlers

logger = logging.getLogger("phloem.router")

# Below uvicorn's 5 s keep-alive on the workers: the router never reuses a connection the worker
# is closing (that would fail a request for nothing).
KEEPALIVE_S = 4.0
DRAIN_S = 5

ROUTED = ("/generate", "/v1/completions", "/v1/chat/completions")
ANY_WORKER_GET = ("/v1/models", "/get_model_info", "/model_info", "/tokenizer", "/health_generate")
ANY_WORKER_POST = ("/v1/tokenize", "/v1/detokenize")


def create_router_app(args: RouterArgs) -> FastAPI:
    args = args.check()
    metrics = RouterMetrics()
    policy = make_policy(
        args.policy,
        load_method=args.load_balance_method,
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        max_tree_chars=args.max_tree_chars,
    )
    pool = WorkerPool(args.worker_urls, policy, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=args.health_check_timeout)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False
        ) as session:
            app.state.proxy = Proxy(pool, metrics, session, args.api_key)
            check = (session, args.health_check_timeout, args.health_failure_threshold)
            await pool.check_all(*check)
            watcher = asyncio.create_task(pool.watch(session, args.health_check_interval, *check[1:]))
            try:
                yield
            finally:
                watcher.cancel()

    app = FastAPI(title="phloem router", redoc_url=None, docs_url=None, lifespan=lifespan)
    app.state.pool = pool
    app.state.metrics = metrics
    install_error_handlers(app)

    def proxy(request: Request) -> Proxy:
        return request.app.state.proxy

    async def routed(request: Request) -> Response:
        return await proxy(request).forward(request, request.url.path)

    async def any_worker(request: Request) -> Response:
        return await proxy(request).forward(request, request.url.path, routed=False)

    for path in ROUTED:
        app.add_api_route(path, routed, methods=["POST"], include_in_schema=False)
    for path in ANY_WORKER_GET:
        app.add_api_route(path, any_worker, methods=["GET"], include_in_schema=False)
    for path in ANY_WORKER_POST:
        app.add_api_route(path, any_worker, methods=["POST"], include_in_schema=False)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        results = await proxy(request).fan_out(request, "/flush_cache")
        for w, status, _ in results:
            if status == 200:
                policy.forget(w.url)  # its cache is empty now
        status = merged_status(results)
        answers = {w.url: answer for w, _, answer in results}
        message = "cache flushed" if status == 200 else "some workers did not flush (see workers)"
        return JSONResponse(
            {"success": status == 200, "message": message, "workers": answers}, status_code=status
        )

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info(request: Request) -> Response:
        """The first answering worker's info at the top (model, options), and every worker's."""
        results = await proxy(request).fan_out(request, "/get_server_info")
        infos = [(w, answer) for w, status, answer in results if status == 200 and isinstance(answer, dict)]
        top: dict[str, Any] = dict(infos[0][1]) if infos else {}
        top["dp_size"] = len(pool.workers)
        top["workers"] = [{"url": w.url, "status": status, "info": answer} for w, status, answer in results]
        return JSONResponse(top, status_code=200 if infos else 502)

    @app.get("/health")
    async def health() -> Response:
        up = len(pool.healthy())
        body = {
            "status": "serving" if up else "no_healthy_worker",
            "healthy_workers": up,
            "workers": len(pool.workers),
        }
        if not up:
            body["message"] = f"no healthy worker: all {len(pool.workers)} workers are out (see GET /workers)"
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/workers")
    async def workers() -> Response:
        return JSONResponse({"policy": policy.name, "workers": [w.describe() for w in pool.workers]})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    return app


class _Server(uvicorn.Server):
    """uvicorn without re-raising the stopping signal on exit: the router exits 0 after a clean
    drain, and ``phloem serve --dp-size`` still stops its workers after it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


async def serve_router(args: RouterArgs, announce: str = "phloem router at") -> None:
    config = uvicorn.Config(
        create_router_app(args),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=DRAIN_S,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
        shown = f"[{args.host}]" if ":" in args.host else args.host
        print(f"{announce} http://{shown}:{port}", flush=True)
    await task


def run_router(args: RouterArgs, announce: str = "phloem router at") -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code."""
    import uvloop

    args = args.check()
    check_port_free(args.host, args.port)
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(message)s")
    uvloop.run(serve_router(args, announce))
    return 0
