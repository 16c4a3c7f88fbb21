"""ServerMetrics: names, scheduler-stat deltas, request observations, exposition format."""

from __future__ import annotations

import math

from phloem.runtime.metrics import FRESHNESS_GAUGES, HISTOGRAMS, SCHEDULER_GAUGES, ServerMetrics
from prometheus_client.parser import text_string_to_metric_families


def families(m: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def value(m: ServerMetrics, name: str, suffix: str = "") -> float:
    for sample in families(m)[name].samples:
        if sample.name == name + suffix:
            return sample.value
    raise KeyError(name + suffix)


def test_every_design_metric_is_exposed_with_prefix_and_model_label():
    fams = families(ServerMetrics("m1"))
    for name in [
        *SCHEDULER_GAUGES,
        *FRESHNESS_GAUGES,
        *HISTOGRAMS,
        "num_retracted_reqs",
        "prompt_tokens",
        "generation_tokens",
        "num_requests",
        "cached_tokens",
    ]:
        assert f"phloem:{name}" in fams, name
    sample = fams["phloem:num_running_reqs"].samples[0]
    assert sample.labels == {"model_name": "m1"}


def test_gauges_are_set_and_counters_advance_by_delta():
    m = ServerMetrics()
    m.update_scheduler_stats(
        {
            "num_running_reqs": 4,
            "num_queue_reqs": 2,
            "token_usage": 0.25,
            "cache_hit_rate": 0.5,
            "gen_throughput": 123.0,
            "num_retracted_reqs": 3,
        }
    )
    m.update_scheduler_stats(
        {"num_running_reqs": 1, "num_retracted_reqs": 5, "unknown": 9, "spec_accept_length": None}
    )
    assert value(m, "phloem:num_running_reqs") == 1
    assert value(m, "phloem:num_queue_reqs") == 2  # missing keys leave gauges alone
    assert value(m, "phloem:gen_throughput") == 123.0
    assert value(m, "phloem:num_retracted_reqs", "_total") == 5
    m.update_scheduler_stats({"num_retracted_reqs": 2})  # scheduler restarted: its total starts over
    assert value(m, "phloem:num_retracted_reqs", "_total") == 7


def test_observe_request_fills_histograms_and_counters():
    m = ServerMetrics()
    m.observe_request(
        ttft=0.05, itls=[0.01, 0.02], e2e=0.2, prompt_tokens=10, completion_tokens=3, cached_tokens=4
    )
    m.observe_request(ttft=None, itls=[], e2e=0.1, prompt_tokens=5, completion_tokens=0)
    assert value(m, "phloem:num_requests", "_total") == 2
    assert value(m, "phloem:prompt_tokens", "_total") == 15
    assert value(m, "phloem:generation_tokens", "_total") == 3
    assert value(m, "phloem:cached_tokens", "_total") == 4
    assert value(m, "phloem:time_to_first_token_seconds", "_count") == 1
    assert value(m, "phloem:inter_token_latency_seconds", "_count") == 2
    assert value(m, "phloem:e2e_request_latency_seconds", "_count") == 2


def test_grammar_compilation_times_from_stats():
    m = ServerMetrics()
    m.update_scheduler_stats({"grammar_compilation_times": [0.1, 0.3]})
    assert value(m, "phloem:grammar_compilation_time_seconds", "_count") == 2


def test_the_stats_timestamp_is_the_wall_time_of_the_last_update():
    m = ServerMetrics()
    assert value(m, "phloem:scheduler_stats_timestamp_seconds") == 0  # never updated
    m.wall_clock = lambda: 1_760_000_000.5
    m.update_scheduler_stats({"num_running_reqs": 1})
    assert value(m, "phloem:scheduler_stats_timestamp_seconds") == 1_760_000_000.5
    m.wall_clock = lambda: 1_760_000_001.5
    m.update_scheduler_stats({})
    assert value(m, "phloem:scheduler_stats_timestamp_seconds") == 1_760_000_001.5


def test_the_heartbeat_age_is_read_at_scrape_time():
    m = ServerMetrics()
    assert math.isnan(value(m, "phloem:scheduler_heartbeat_age_seconds"))  # no source yet
    age = [0.4]
    m.watch_heartbeat(lambda: age[0])
    assert value(m, "phloem:scheduler_heartbeat_age_seconds") == 0.4
    age[0] = 7.25
    assert value(m, "phloem:scheduler_heartbeat_age_seconds") == 7.25


def test_the_server_exposes_the_managers_heartbeat_age():
    from phloem.runtime.server.app import create_app
    from starlette.testclient import TestClient

    from tests.unit.test_server_fake_tm import FakeTokenizerManager

    tm = FakeTokenizerManager(metrics_prefix="sglang")
    client = TestClient(create_app(tm))
    tm.now += 3.5  # seconds since the newest heartbeat
    fams = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert fams["sglang:scheduler_heartbeat_age_seconds"].samples[0].value == 3.5
    assert "sglang:scheduler_stats_timestamp_seconds" in fams


def test_registries_are_private():
    a, b = ServerMetrics(), ServerMetrics()
    a.update_scheduler_stats({"num_running_reqs": 7})
    assert value(b, "phloem:num_running_reqs") == 0


def test_the_sglang_prefix_names_every_metric_as_sglang_dashboards_read_them():
    from phloem.runtime.config import EngineArgs
    from phloem.runtime.server.app import create_app
    from starlette.testclient import TestClient

    from tests.unit.test_server_fake_tm import FakeTokenizerManager

    tm = FakeTokenizerManager()
    tm.args = EngineArgs(metrics_prefix="sglang")
    client = TestClient(create_app(tm))
    body = client.get("/metrics").text
    names = {f.name for f in text_string_to_metric_families(body)}
    assert {"sglang:num_running_reqs", "sglang:token_usage", "sglang:time_to_first_token_seconds",
            "sglang:e2e_request_latency_seconds", "sglang:generation_tokens"} <= names  # fmt: skip
    assert not any(n.startswith("phloem:") for n in names)


def test_an_unknown_prefix_is_refused():
    import pytest

    with pytest.raises(ValueError, match="metrics prefix 'vllm'"):
        ServerMetrics(prefix="vllm")


def test_the_example_dashboard_reads_only_metrics_we_export():
    """examples/grafana-dashboard.json (SGLang's names) asks only for series ``--metrics-prefix
    sglang`` exports."""
    import json
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parents[2] / "examples" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append(dash["templating"]["list"][1]["query"])
    used = {m for e in exprs for m in re.findall(r"sglang:([a-z0-9_]+)", e)}
    body = ServerMetrics(prefix="sglang").render().decode()
    series = {s.name.removeprefix("sglang:") for f in text_string_to_metric_families(body) for s in f.samples}
    assert used and used <= series, used - series
