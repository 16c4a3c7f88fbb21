"""The soak benchmark, shortened: 40 mixed requests over about 20 s against the real server."""

from __future__ import annotations

import asyncio

from phloem.bench.soak import KINDS, SoakOptions, run


def test_soak_smoke_reports_and_the_pool_returns_to_idle(server):
    opts = SoakOptions(requests=40, duration_s=20.0, concurrency=4, max_prompt_words=20, max_new_tokens=4,
                       windows=2, sample_interval_s=2.0, idle_timeout_s=30.0, request_timeout_s=120.0)
    report = asyncio.run(run(server.url, opts, pid=server.proc.pid))

    assert report["requests"]["sent"] == 40
    assert set(report["requests"]["by_kind"]) <= set(KINDS)
    statuses = report["requests"]["by_status"]
    assert not [s for s in statuses if s.startswith("5") or s.startswith("error")], statuses
    assert report["idle"]["pool_idle"], report["idle"]
    assert report["cache_back_to_idle"], (report["cache_before"], report["cache_after"])
    assert len(report["latency_windows"]) == 2 and report["latency_windows"][0]["count"] > 0
    assert report["p99_first_s"] > 0 and isinstance(report["p99_stable"], bool)
    assert report["rss"]["start_mb"] > 0 and report["rss"]["growth_mb"] == (
        report["rss"]["end_mb"] - report["rss"]["start_mb"])
    assert len(report["samples"]) >= 3
