"""The router over fake workers (small aiohttp apps): routing, streams, retries, health, auth."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import requests
import uvicorn
from aiohttp import web
from phloem.runtime.router.app import create_router_app
from phloem.runtime.router.config import RouterArgs

KEY = "router-test-key"


class FakeWorker:
    """A worker that answers /generate with its name, streams 3 events, and can misbehave."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"  # ok | drop (close before answering) | cut (close mid-stream) | sick (/health 503) | slow
        self.left: list[bool] = []  # slow mode: whether the router had closed the connection by the answer
        self.seen: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.flushed = 0
        self.port = 0
        self.runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_route("*", "/flush_cache", self.flush)
        app.router.add_get("/get_server_info", self.info)
        return app

    async def start(self) -> None:
        self.runner = web.AppRunner(self.app())
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "serving"}, status=503 if self.mode == "sick" else 200)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        self.auth.append(request.headers.get("Authorization"))
        if self.mode == "slow":
            await asyncio.sleep(2.0)
            self.left.append(request.transport is None or request.transport.is_closing())
        if self.mode == "drop":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0.05)
            return web.Response()
        if not body.get("stream"):
            return web.json_response({"text": f"from {self.name}", "meta_info": {}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(b"data: " + json.dumps({"text": f"{self.name}-{i}"}).encode() + b"\n\n")
            if self.mode == "cut" and i == 1:
                await asyncio.sleep(0.2)  # the router relays what was sent (data behind a cut is lost)
                assert request.transport is not None
                request.transport.close()
                return resp
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake"}]})

    async def flush(self, request: web.Request) -> web.Response:
        self.flushed += 1
        return web.json_response({"success": True})

    async def info(self, request: web.Request) -> web.Response:
        return web.json_response({"name": self.name, "model_path": "fake"})


class Harness:
    """Two fake workers and a router (uvicorn) on one event loop in a background thread."""

    def __init__(self, **router_args: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.workers = [FakeWorker("w0"), FakeWorker("w1")]
        for w in self.workers:
            self.call(w.start())
        args = RouterArgs(
            worker_urls=tuple(w.url for w in self.workers), port=0, health_check_interval=0.1,
            health_failure_threshold=1, log_level="warning", **router_args,
        )  # fmt: skip
        self.app = create_router_app(args)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.task = asyncio.run_coroutine_threadsafe(self.server.serve(), self.loop)
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        self.server.should_exit = True
        self.task.result(10)
        for w in self.workers:
            self.call(w.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    def worker_state(self) -> dict[str, dict[str, Any]]:
        return {w["url"]: w for w in requests.get(self.url + "/workers", timeout=5).json()["workers"]}

    def wait(self, cond: Any, timeout: float = 5.0) -> None:
        deadline = time.time() + timeout
        while not cond():
            assert time.time() < deadline, "condition not reached"
            time.sleep(0.05)


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def post(h: Harness, body: dict[str, Any], path: str = "/generate", **kw: Any) -> requests.Response:
    return requests.post(h.url + path, json=body, timeout=10, **kw)


def test_routes_answers_and_tags_them_with_the_worker(harness: Harness):
    r = post(harness, {"text": "hello " * 50})
    assert r.status_code == 200
    worker = r.headers["x-phloem-worker"]
    assert r.json()["text"] == f"from {'w0' if worker == harness.workers[0].url else 'w1'}"
    again = post(harness, {"text": "hello " * 50 + "again"})
    assert again.headers["x-phloem-worker"] == worker  # the shared prefix follows the cache
    state = harness.worker_state()[worker]
    assert state["requests"] == 2 and state["cache_hits"] == 1 and state["in_flight"] == 0
    models = requests.get(harness.url + "/v1/models", timeout=5).json()
    assert models["data"][0]["id"] == "fake"


def test_streams_pass_through_chunk_by_chunk(harness: Harness):
    with requests.post(harness.url + "/generate", json={"text": "x", "stream": True}, stream=True, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = b"".join(r.iter_content(None))
    name = "w0" if r.headers["x-phloem-worker"] == harness.workers[0].url else "w1"
    expected = b"".join(b'data: {"text": "%s-%d"}\n\n' % (name.encode(), i) for i in range(3)) + b"data: [DONE]\n\n"
    assert body == expected


def test_a_worker_that_drops_the_request_before_answering_is_retried_on_the_other(harness: Harness):
    w0, w1 = harness.workers
    w0.mode = "drop"
    for i in range(4):
        r = post(harness, {"text": f"prompt {i}"})
        assert r.status_code == 200 and r.json()["text"] == "from w1"
    assert w1.seen and len(w0.seen) >= 1
    metrics = requests.get(harness.url + "/metrics", timeout=5).text
    assert "phloem_router_retries_total" in metrics
    assert _sample(metrics, "phloem_router_retries_total") >= 1


def test_a_refused_worker_is_taken_out_and_put_back_when_healthy(harness: Harness):
    w0, w1 = harness.workers
    harness.call(w0.stop())
    for i in range(3):
        assert post(harness, {"text": f"p{i}"}).json()["text"] == "from w1"
    assert harness.worker_state()[w0.url]["healthy"] is False
    metrics = requests.get(harness.url + "/metrics", timeout=5).text
    assert _sample(metrics, "phloem_router_worker_healthy", w0.url) == 0
    assert _sample(metrics, "phloem_router_healthy_workers") == 1
    harness.call(w0.start())  # the same port again
    harness.wait(lambda: harness.worker_state()[w0.url]["healthy"])
    assert _sample(requests.get(harness.url + "/metrics", timeout=5).text, "phloem_router_worker_healthy", w0.url) == 1


def test_a_stream_cut_by_its_worker_ends_with_an_error_event_naming_it(harness: Harness):
    for w in harness.workers:
        w.mode = "cut"
    with requests.post(harness.url + "/generate", json={"text": "x", "stream": True}, stream=True, timeout=10) as r:
        body = b"".join(r.iter_content(None)).decode()
    events = [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 502 and r.headers["x-phloem-worker"] in err["message"]
    assert "mid-stream" in err["message"]
    assert len(events) == 4  # two chunks, the error, [DONE]


def test_a_client_that_leaves_releases_its_worker(harness: Harness):
    for w in harness.workers:
        w.mode = "slow"
    with pytest.raises(requests.ReadTimeout):
        requests.post(harness.url + "/generate", json={"text": "x"}, timeout=0.3)
    harness.wait(lambda: all(s["in_flight"] == 0 for s in harness.worker_state().values()), timeout=1.5)
    harness.wait(lambda: any(w.left for w in harness.workers), timeout=5)
    assert [left for w in harness.workers for left in w.left] == [True]  # the worker's connection closed


def test_no_healthy_worker_is_a_503_that_says_so(harness: Harness):
    for w in harness.workers:
        w.mode = "sick"
    harness.wait(lambda: not any(s["healthy"] for s in harness.worker_state().values()))
    r = post(harness, {"text": "x"})
    assert r.status_code == 503
    assert "no healthy worker" in r.json()["error"]["message"]
    assert requests.get(harness.url + "/health", timeout=5).status_code == 503
    for w in harness.workers:
        w.mode = "ok"
    harness.wait(lambda: requests.get(harness.url + "/health", timeout=5).status_code == 200)


def test_flush_and_server_info_go_to_every_worker(harness: Harness):
    post(harness, {"text": "cached text " * 20})
    r = requests.post(harness.url + "/flush_cache", timeout=5)
    assert r.status_code == 200 and r.json()["success"] is True
    assert [w.flushed for w in harness.workers] == [1, 1]
    policy = harness.app.state.pool.policy
    assert all(t.size == 0 for t in policy.trees.values())  # the workers' caches are empty now
    info = requests.get(harness.url + "/get_server_info", timeout=5).json()
    assert info["dp_size"] == 2 and info["model_path"] == "fake"
    assert sorted(w["info"]["name"] for w in info["workers"]) == ["w0", "w1"]


def test_chat_messages_route_by_their_rendered_text(harness: Harness):
    system = {"role": "system", "content": "You answer in French. " * 30}
    first = post(harness, {"messages": [system, {"role": "user", "content": "hi"}]}, "/v1/chat/completions")
    second = post(harness, {"messages": [system, {"role": "user", "content": "bye"}]}, "/v1/chat/completions")
    assert first.headers["x-phloem-worker"] == second.headers["x-phloem-worker"]


def test_api_key_is_required_and_forwarded():
    h = Harness(api_key=KEY)
    try:
        assert post(h, {"text": "x"}).status_code == 401
        assert requests.get(h.url + "/health", timeout=5).status_code == 200  # public
        assert requests.get(h.url + "/metrics", timeout=5).status_code == 200
        r = post(h, {"text": "x"}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200
        assert [a for w in h.workers for a in w.auth] == [f"Bearer {KEY}"]
    finally:
        h.close()


def test_bad_router_options_name_the_flag():
    with pytest.raises(ValueError, match="--worker-urls"):
        RouterArgs().check()
    with pytest.raises(ValueError, match="--cache-threshold"):
        RouterArgs(worker_urls=("a:1",), cache_threshold=2).check()
    with pytest.raises(ValueError, match="listed twice"):
        RouterArgs(worker_urls=("a:1", "http://a:1/")).check()
    assert "router-test-key" not in repr(RouterArgs(worker_urls=("a:1",), api_key=KEY))


def _sample(text: str, name: str, worker: str | None = None) -> float:
    for line in text.splitlines():
        if line.startswith(name) and (worker is None or f'worker="{worker}"' in line):
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] in (name, name + "_total"):
                return float(value)
    raise AssertionError(f"{name} not in metrics")


def test_client_session_is_closed_with_the_router():
    h = Harness()
    proxy = h.app.state.proxy
    h.close()
    assert isinstance(proxy.session, aiohttp.ClientSession) and proxy.session.closed
