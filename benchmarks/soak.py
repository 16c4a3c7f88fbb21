"""``python -m phloem.bench.soak``: a long mixed load against a running server, then a leak check.

    python -m phloem.bench.soak --base-url http://127.0.0.1:30000 --pid <server pid> \\
        --requests 10000 --duration-s 3600 --output soak.json

Requests are spread evenly over ``--duration-s`` (at most ``--concurrency`` in flight) and mix prompt
and output lengths, grammars (json_schema, regex), streamed and whole answers, aborts through
``/abort_request`` and clients that disconnect mid-stream. ``/get_server_info`` (and the RSS of the
server's process tree, with ``--pid``) is sampled during the run. At the end the tool waits for the
server to go idle and writes a JSON report: whether the KV pool came back (available tokens equal
the pool's size, nothing running or queued), the radix tree and host tier sizes after a cache flush
against the figures before the run, the RSS growth against ``--rss-bound-mb``, p50/p99 latency per
time window ("p99 stable": the last window's p99 within ``--p99-factor`` of the first's), and the
answers counted by status. Its exit status is 0 when every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

KINDS = ("generate", "stream", "json_schema", "regex", "chat_stream", "abort", "disconnect")
WEIGHTS = (30, 20, 10, 10, 10, 10, 10)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}
WORDS = "the quick brown fox jumps over a lazy dog while seven tired owls count stars at night".split()


@dataclass
class Record:
    """One request's outcome: ``status`` is the HTTP status, or ``error:<kind>`` when none came."""

    kind: str
    start_s: float  # since the run started
    latency_s: float
    status: str


@dataclass
class Sample:
    t_s: float
    live: dict[str, Any]
    rss_mb: float | None


@dataclass
class SoakOptions:
    requests: int = 10_000
    duration_s: float = 3600.0
    concurrency: int = 8
    max_prompt_words: int = 400
    max_new_tokens: int = 64
    windows: int = 6
    sample_interval_s: float = 10.0
    rss_bound_mb: float = 256.0
    p99_factor: float = 2.0
    idle_timeout_s: float = 60.0
    flush: bool = True
    seed: int = 0
    request_timeout_s: float = 300.0


# ---- figures (pure, unit-tested) -----------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by the nearest-rank rule; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = min(max(1, math.ceil(q * len(ordered))), len(ordered))
    return ordered[rank - 1]


def latency_windows(records: list[Record], duration_s: float, windows: int) -> list[dict[str, Any]]:
    """p50/p99 of the completed (200) requests of each time window, by when they started."""
    width = duration_s / windows
    out = []
    for w in range(windows):
        lo, hi = w * width, (w + 1) * width
        lat = [r.latency_s for r in records
               if r.status == "200" and r.kind not in ("abort", "disconnect")
               and (lo <= r.start_s < hi or (w == windows - 1 and r.start_s >= hi))]
        out.append({"start_s": round(lo, 3), "end_s": round(hi, 3), "count": len(lat),
                    "p50_s": percentile(lat, 0.5), "p99_s": percentile(lat, 0.99)})
    return out


def p99_stability(windows: list[dict[str, Any]], factor: float) -> dict[str, Any]:
    """The first and last windows' p99 (of those with requests) and whether the last is within ``factor``."""
    filled = [w for w in windows if w["p99_s"] is not None]
    if len(filled) < 2:
        return {"p99_first_s": None, "p99_last_s": None, "p99_ratio": None, "p99_stable": None}
    first, last = filled[0]["p99_s"], filled[-1]["p99_s"]
    ratio = last / first if first > 0 else None
    return {"p99_first_s": first, "p99_last_s": last, "p99_ratio": ratio,
            "p99_stable": ratio is not None and ratio <= factor}


def pool_idle(live: dict[str, Any]) -> bool:
    return (live.get("available_tokens") == live.get("max_total_num_tokens")
            and live.get("num_running_reqs") == 0 and live.get("num_queue_reqs", 0) == 0)


def cache_figures(live: dict[str, Any]) -> dict[str, Any]:
    """The radix tree and host tier sizes ``live`` reports (the host tier only when enabled)."""
    keys = ("evictable_tokens", "available_tokens", "max_total_num_tokens", "hicache_host_used_tokens")
    return {k: live[k] for k in keys if k in live}


def rss_report(samples: list[Sample], bound_mb: float) -> dict[str, Any] | None:
    rss = [s.rss_mb for s in samples if s.rss_mb is not None]
    if not rss:
        return None
    growth = rss[-1] - rss[0]
    return {"start_mb": rss[0], "end_mb": rss[-1], "peak_mb": max(rss), "growth_mb": growth,
            "bound_mb": bound_mb, "within_bound": growth <= bound_mb}


def build_report(records: list[Record], samples: list[Sample], before: dict[str, Any], after: dict[str, Any],
                 opts: SoakOptions, elapsed_s: float) -> dict[str, Any]:
    """The JSON report; ``ok`` is true when every check that could be made passed."""
    statuses: dict[str, int] = {}
    kinds: dict[str, int] = {}
    for r in records:
        statuses[r.status] = statuses.get(r.status, 0) + 1
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    windows = latency_windows(records, max(elapsed_s, opts.duration_s), opts.windows)
    stability = p99_stability(windows, opts.p99_factor)
    rss = rss_report(samples, opts.rss_bound_mb)
    cache_before, cache_after = cache_figures(before), cache_figures(after)
    idle = {"pool_idle": pool_idle(after), **{k: after.get(k) for k in (
        "available_tokens", "max_total_num_tokens", "num_running_reqs", "num_queue_reqs")}}
    cache_back = cache_after == cache_before if opts.flush else None
    checks = [idle["pool_idle"], stability["p99_stable"], rss["within_bound"] if rss else None, cache_back,
              not any(s.startswith("5") or s.startswith("error") for s in statuses)]
    return {
        "options": asdict(opts),
        "elapsed_s": elapsed_s,
        "requests": {"sent": len(records), "by_kind": kinds, "by_status": dict(sorted(statuses.items())),
                     "p50_s_by_kind": {k: percentile([r.latency_s for r in records if r.kind == k], 0.5)
                                       for k in sorted(kinds)}},
        "latency_windows": windows,
        **stability,
        "p99_factor": opts.p99_factor,
        "idle": idle,
        "cache_before": cache_before,
        "cache_after": cache_after,
        "cache_back_to_idle": cache_back,
        "rss": rss,
        "samples": [asdict(s) | {"live": cache_figures(s.live) | {k: s.live.get(k) for k in (
            "num_running_reqs", "num_queue_reqs", "token_usage")}} for s in samples],
        "ok": all(c is not False for c in checks),
    }


# ---- the load ------------------------------------------------------------------------------------
def prompt(rng: random.Random, max_words: int) -> str:
    n = int(rng.paretovariate(1.2) * 4)  # mostly short, now and then long
    return " ".join(rng.choice(WORDS) for _ in range(max(1, min(n, max_words))))


def request_for(kind: str, rng: random.Random, opts: SoakOptions) -> tuple[str, dict[str, Any]]:
    """The route and body of one request of ``kind``."""
    text = prompt(rng, opts.max_prompt_words)
    sampling: dict[str, Any] = {"max_new_tokens": rng.randint(1, opts.max_new_tokens), "temperature": rng.choice([0, 0.7, 1.0])}
    if kind == "chat_stream":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "stream": True,
                                        "max_tokens": sampling["max_new_tokens"]}
    if kind == "regex":
        return "/v1/completions", {"prompt": text, "regex": r"[0-9]{1,6}( [a-z]{2,8}){0,4}",
                                   "max_tokens": sampling["max_new_tokens"]}
    if kind == "json_schema":
        sampling["json_schema"] = json.dumps(SCHEMA)
    body: dict[str, Any] = {"text": text, "sampling_params": sampling, "rid": f"soak-{uuid.uuid4().hex}"}
    if kind in ("stream", "abort", "disconnect"):
        body["stream"] = True
        sampling["max_new_tokens"] = max(sampling["max_new_tokens"], 8)  # long enough to cut short
    return "/generate", body


async def one_request(session: aiohttp.ClientSession, url: str, kind: str, route: str, body: dict[str, Any],
                      t0: float, timeout_s: float) -> Record:
    start = time.monotonic()
    status = "error:unknown"
    try:
        async with session.post(url + route, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            status = str(resp.status)
            if kind in ("abort", "disconnect") and resp.status == 200:
                await resp.content.readline()  # the first event: the request is running
                if kind == "abort":
                    async with session.post(url + "/abort_request", json={"rid": body["rid"]}) as ab:
                        status = f"abort:{ab.status}"
                    await resp.read()
                else:
                    resp.close()  # the client goes away mid-stream
                    status = "disconnect"
            else:
                await resp.read()
    except asyncio.TimeoutError:
        status = "error:timeout"
    except aiohttp.ClientError as exc:
        status = f"error:{type(exc).__name__}"
    return Record(kind, start - t0, time.monotonic() - start, status)


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of ``pid`` and all its descendants (the engine's processes), in MiB."""
    if pid is None:
        return None
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
        return sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20
    except psutil.Error:
        return None


async def live(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/get_server_info") as resp:
        return dict((await resp.json())["live"])


async def wait_idle(session: aiohttp.ClientSession, url: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = await live(session, url)
        if pool_idle(state) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.25)


async def run(url: str, opts: SoakOptions, pid: int | None = None) -> dict[str, Any]:
    rng = random.Random(opts.seed)
    url = url.rstrip("/")
    async with aiohttp.ClientSession() as session:
        if opts.flush:
            await session.post(url + "/flush_cache", json={"timeout": opts.idle_timeout_s})
        before = await wait_idle(session, url, opts.idle_timeout_s)
        samples = [Sample(0.0, before, rss_mb(pid))]
        records: list[Record] = []
        gate = asyncio.Semaphore(opts.concurrency)
        t0 = time.monotonic()
        done = asyncio.Event()

        async def sampler() -> None:
            while not done.is_set():
                try:
                    await asyncio.wait_for(done.wait(), opts.sample_interval_s)
                except asyncio.TimeoutError:
                    samples.append(Sample(time.monotonic() - t0, await live(session, url), rss_mb(pid)))

        async def launch(i: int, kind: str, route: str, body: dict[str, Any]) -> None:
            await asyncio.sleep(max(0.0, i * opts.duration_s / opts.requests - (time.monotonic() - t0)))
            async with gate:
                records.append(await one_request(session, url, kind, route, body, t0, opts.request_timeout_s))

        sampling = asyncio.create_task(sampler())
        plan = [(i, kind, *request_for(kind, rng, opts))
                for i, kind in enumerate(rng.choices(KINDS, WEIGHTS, k=opts.requests))]
        await asyncio.gather(*(launch(*p) for p in plan))
        elapsed = time.monotonic() - t0
        done.set()
        await sampling
        after = await wait_idle(session, url, opts.idle_timeout_s)
        if opts.flush:  # what the cache holds is kept on purpose; emptied, it must match the start
            await session.post(url + "/flush_cache", json={"timeout": opts.idle_timeout_s})
            after = await wait_idle(session, url, opts.idle_timeout_s)
        samples.append(Sample(time.monotonic() - t0, after, rss_mb(pid)))
    return build_report(records, samples, before, after, opts, elapsed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m phloem.bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True)
    p.add_argument("--pid", type=int, default=None, help="server process id, for its RSS (psutil)")
    p.add_argument("--output", default="soak.json", help="the JSON report")
    defaults = SoakOptions()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument("--no-" + name.replace("_", "-"), dest=name, action="store_false")
        else:
            p.add_argument(flag, type=type(value), default=value)
    ns = p.parse_args(argv)
    opts = SoakOptions(**{k: getattr(ns, k) for k in asdict(defaults)})
    report = asyncio.run(run(ns.base_url, opts, ns.pid))
    with open(ns.output, "w") as f:
        json.dump(report, f, indent=1)
    summary = {k: report[k] for k in ("requests", "p99_first_s", "p99_last_s", "p99_stable", "idle",
                                      "cache_back_to_idle", "rss", "ok")}
    print(json.dumps(summary, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
