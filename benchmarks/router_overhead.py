"""What the router adds to a request: the same ``/generate`` sent straight to a worker and through
``phloem router``, one at a time over kept-alive connections, interleaved so load drifts hit both
paths alike. The p50 difference is the router's cost per request (parse, route, forward, relay).

    python -m phloem.bench.router_overhead                      # a trivial fake worker
    python -m phloem.bench.router_overhead --worker-url http://127.0.0.1:30000 --requests 200

With ``--stream`` the requests stream (the time is to the last byte). ``--prompt-chars`` sets the
prompt length the cache-aware policy matches and stores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import requests


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_fake(port: int) -> None:
    """A worker that answers at once: ``/health``, and ``/generate`` with a fixed small answer
    (streamed as three SSE events when asked to)."""
    from aiohttp import web

    answer = {"text": " four", "meta_info": {"prompt_tokens": 8, "completion_tokens": 1, "cached_tokens": 0}}

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "serving"})

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(3):
            await resp.write(b"data: " + json.dumps(answer).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/generate", generate)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def _wait(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy")


def _one(session: requests.Session, url: str, body: dict[str, Any], stream: bool) -> float:
    t = time.perf_counter()
    r = session.post(url + "/generate", json=body, stream=stream, timeout=300)
    for _ in r.iter_content(None):
        pass
    r.raise_for_status()
    return time.perf_counter() - t


def _stats(lat: list[float]) -> dict[str, float]:
    lat = sorted(lat)
    return {
        "p50_ms": 1000 * statistics.median(lat),
        "p90_ms": 1000 * lat[int(0.9 * (len(lat) - 1))],
        "mean_ms": 1000 * statistics.fmean(lat),
    }


def measure(worker: str, router: str, n: int, prompt_chars: int, stream: bool) -> dict[str, Any]:
    direct, routed = requests.Session(), requests.Session()
    prefix = ("The quick brown fox jumps over the lazy dog. " * (prompt_chars // 45 + 1))[:prompt_chars]
    params = {"max_new_tokens": 1, "temperature": 0}
    for i in range(10):  # warm both paths (connections, first-use imports)
        body = {"text": f"{prefix} {i}", "sampling_params": params, "stream": stream}
        _one(direct, worker, body, stream)
        _one(routed, router, body, stream)
    lat_direct, lat_router = [], []
    for i in range(n):
        body = {"text": f"{prefix} request {i}", "sampling_params": params, "stream": stream}
        first, second = (direct, routed) if i % 2 == 0 else (routed, direct)
        a = _one(first, worker if first is direct else router, body, stream)
        b = _one(second, worker if second is direct else router, body, stream)
        (lat_direct if first is direct else lat_router).append(a)
        (lat_direct if second is direct else lat_router).append(b)
    d, r = _stats(lat_direct), _stats(lat_router)
    return {
        "requests": n,
        "prompt_chars": prompt_chars,
        "stream": stream,
        "direct": d,
        "router": r,
        "added_p50_ms": r["p50_ms"] - d["p50_ms"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m phloem.bench.router_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--worker-url", help="a running phloem serve (default: start a trivial fake worker)")
    p.add_argument("--requests", type=int, default=500, help="requests per path")
    p.add_argument("--prompt-chars", type=int, default=1000)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--policy", default="cache_aware", choices=("cache_aware", "round_robin", "shortest_queue"))
    p.add_argument("--serve-fake", type=int, help=argparse.SUPPRESS)  # the fake worker's own process
    ns = p.parse_args(argv)
    if ns.serve_fake:
        serve_fake(ns.serve_fake)
        return 0
    procs: list[subprocess.Popen] = []
    try:
        worker = ns.worker_url
        if worker is None:
            port = _free_port()
            worker = f"http://127.0.0.1:{port}"
            procs.append(subprocess.Popen([sys.executable, "-m", "phloem.bench.router_overhead", "--serve-fake", str(port)]))
            _wait(worker, procs[-1])
        port = _free_port()
        router = f"http://127.0.0.1:{port}"
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "phloem", "router", "--worker-urls", worker, "--port", str(port),
                 "--policy", ns.policy, "--log-level", "warning"],
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
        )
        _wait(router, procs[-1])
        result = measure(worker, router, ns.requests, ns.prompt_chars, ns.stream)
        result["worker"] = "fake" if ns.worker_url is None else ns.worker_url
        result["policy"] = ns.policy
        print(json.dumps(result, indent=2))
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
