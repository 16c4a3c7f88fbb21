"""The soak benchmark's figures: percentiles, latency windows, p99 stability and the report's verdict."""

from __future__ import annotations

from phloem.bench.soak import (
    Record,
    Sample,
    SoakOptions,
    build_report,
    latency_windows,
    p99_stability,
    percentile,
    pool_idle,
)

IDLE = {"available_tokens": 100, "max_total_num_tokens": 100, "num_running_reqs": 0, "num_queue_reqs": 0,
        "evictable_tokens": 0}


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([], 0.5) is None


def test_windows_split_by_start_and_count_only_whole_answers():
    records = [Record("generate", 1.0, 0.1, "200"), Record("stream", 6.0, 0.4, "200"),
               Record("abort", 6.5, 9.0, "abort:200"), Record("generate", 7.0, 5.0, "400"),
               Record("generate", 12.0, 0.3, "200")]  # started after the last window: counted in it
    windows = latency_windows(records, 10.0, 2)
    assert [w["count"] for w in windows] == [1, 2]
    assert windows[0]["p99_s"] == 0.1 and windows[1]["p99_s"] == 0.4


def test_p99_stable_within_factor_of_the_first_window():
    windows = [{"p99_s": 1.0}, {"p99_s": None}, {"p99_s": 1.9}]
    assert p99_stability(windows, 2.0)["p99_stable"] is True
    assert p99_stability(windows, 1.5)["p99_stable"] is False
    assert p99_stability([{"p99_s": 1.0}], 2.0)["p99_stable"] is None


def test_pool_idle_needs_every_token_back_and_nothing_running():
    assert pool_idle(IDLE)
    assert not pool_idle(IDLE | {"available_tokens": 99})
    assert not pool_idle(IDLE | {"num_running_reqs": 1})


def test_report_fails_on_a_leak_a_server_error_or_rss_growth():
    opts = SoakOptions(requests=2, duration_s=2.0, windows=1, rss_bound_mb=10.0)
    records = [Record("generate", 0.0, 0.1, "200"), Record("stream", 1.0, 0.2, "200")]
    samples = [Sample(0.0, IDLE, 100.0), Sample(2.0, IDLE, 105.0)]
    good = build_report(records, samples, IDLE, IDLE, opts, 2.0)
    assert good["ok"] and good["idle"]["pool_idle"] and good["rss"]["growth_mb"] == 5.0
    assert good["requests"]["by_status"] == {"200": 2} and good["cache_back_to_idle"] is True

    leaked = IDLE | {"available_tokens": 90, "evictable_tokens": 10}
    assert not build_report(records, samples, IDLE, leaked, opts, 2.0)["ok"]
    errors = [*records, Record("generate", 1.5, 0.1, "500")]
    assert not build_report(errors, samples, IDLE, IDLE, opts, 2.0)["ok"]
    grown = [Sample(0.0, IDLE, 100.0), Sample(2.0, IDLE, 150.0)]
    report = build_report(records, grown, IDLE, IDLE, opts, 2.0)
    assert not report["ok"] and report["rss"]["within_bound"] is False
