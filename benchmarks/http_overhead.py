"""Is the HTTP + tokenizer path a bottleneck? ``/generate`` with ``max_new_tokens: 1`` at a fixed
concurrency through real HTTP, against the same requests through the in-process Engine.

    python -m phloem.bench.http_overhead --requests 512 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from typing import Any


def _prompts(n: int) -> list[str]:
    return [f"Request {i}: say one word about the number {i}." for i in range(n)]


def _summary(name: str, lat: list[float], wall: float) -> dict[str, Any]:
    lat = sorted(lat)
    return {
        "path": name,
        "requests": len(lat),
        "req_per_s": len(lat) / wall,
        "p50_ms": 1000 * statistics.median(lat),
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "wall_s": wall,
    }


async def _bounded(n: int, conc: int, one) -> tuple[list[float], float]:
    sem = asyncio.Semaphore(conc)
    lat: list[float] = []

    async def run(i: int) -> None:
        async with sem:
            t = time.perf_counter()
            await one(i)
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(run(i) for i in range(n)))
    return lat, time.perf_counter() - t0


def bench_engine(prompts: list[str], conc: int) -> dict[str, Any]:
    from phloem import Engine

    params = {"max_new_tokens": 1, "temperature": 0}
    with Engine(log_level="warning") as eng:
        asyncio.run(_bounded(16, conc, lambda i: eng.async_generate(prompts[i], sampling_params=params)))

        async def one(i: int) -> None:
            out = await eng.async_generate(prompts[i], sampling_params=params)
            assert out["meta_info"]["completion_tokens"] == 1

        lat, wall = asyncio.run(_bounded(len(prompts), conc, one))
    return _summary("Engine (in-process)", lat, wall)


def bench_http(prompts: list[str], conc: int) -> dict[str, Any]:
    import aiohttp
    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "phloem", "serve", "--port", str(port), "--log-level", "warning"])
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(0.5)

        async def main() -> tuple[list[float], float]:
            conn = aiohttp.TCPConnector(limit=conc)
            async with aiohttp.ClientSession(connector=conn) as session:

                async def one(i: int) -> None:
                    body = {"text": prompts[i], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
                    async with session.post(url + "/generate", json=body) as r:
                        out = await r.json()
                        assert r.status == 200 and out["meta_info"]["completion_tokens"] == 1

                await _bounded(16, conc, one)
                return await _bounded(len(prompts), conc, one)

        lat, wall = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return _summary("HTTP /generate", lat, wall)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--output", default="benchmarks/results/cpu/http_overhead.json")
    args = ap.parse_args(argv)
    prompts = _prompts(args.requests)
    rows = [bench_engine(prompts, args.concurrency), bench_http(prompts, args.concurrency)]
    print(f"{'path':<22} {'req/s':>8} {'p50 ms':>9} {'p99 ms':>9}")
    for r in rows:
        print(f"{r['path']:<22} {r['req_per_s']:>8.1f} {r['p50_ms']:>9.1f} {r['p99_ms']:>9.1f}")
    ratio = rows[1]["req_per_s"] / rows[0]["req_per_s"]
    print(f"HTTP / Engine throughput ratio: {ratio:.2f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "command": "python -m phloem.bench.http_overhead " + " ".join(argv or sys.argv[1:]),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "rows": rows,
        "http_over_engine": ratio,
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
