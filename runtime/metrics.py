"""Prometheus collectors for the serving process (docs/design.md §10).

``ServerMetrics`` owns a private ``CollectorRegistry`` so several engines (or tests) in one process
never collide in the global registry. Two feeds update it:

- the scheduler process sends a stats dict every few steps; the tokenizer manager hands it to
  ``update_scheduler_stats`` (gauges are set, cumulative counters are advanced by their delta);
- the tokenizer manager calls ``observe_request`` once per finished request (latency histograms and
  the request/token counters).

Two gauges say how fresh the scheduler's figures are: the Unix time of the last stats dict, and the
seconds since the scheduler's newest heartbeat, read at scrape time (``watch_heartbeat``).

Every metric is named ``<prefix>:<name>`` and labelled with ``model_name``; the prefix is ``phloem``,
or ``sglang`` (``--metrics-prefix``), whose names are the same, so dashboards built for SGLang read
them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIXES = ("phloem", "sglang")
CONTENT_TYPE = CONTENT_TYPE_LATEST

# name -> help. Set from the scheduler's stats dict.
SCHEDULER_GAUGES: dict[str, str] = {
    "num_running_reqs": "Requests in the running batch",
    "num_queue_reqs": "Requests in the waiting queue",
    "num_grammar_queue_reqs": "Requests waiting for their grammar to compile",
    "token_usage": "Fraction of KV pool slots in use",
    "cache_hit_rate": "Prefix cache hit rate (cached / prompt tokens) of recent prefills",
    "gen_throughput": "Decode throughput in tokens per second",
    "spec_accept_length": "Mean accepted draft length per verify step",
    "decode_step_ms": "Measured device time of one decode step, which sets continuous decode's steps per launch",
}
# name -> help. How fresh the scheduler's figures are (set by ``ServerMetrics`` itself).
FRESHNESS_GAUGES: dict[str, str] = {
    "scheduler_stats_timestamp_seconds": "Unix time of the last scheduler stats update (the gauges above)",
    "scheduler_heartbeat_age_seconds": "Seconds since the scheduler's newest heartbeat, at scrape time",
}
# name -> help. Cumulative totals in the scheduler's stats dict; advanced by their delta.
SCHEDULER_COUNTERS: dict[str, str] = {
    "num_retracted_reqs": "Requests retracted to the waiting queue because the KV pool was full",
}
# name -> help. Advanced by observe_request (exposed with a ``_total`` suffix).
REQUEST_COUNTERS: dict[str, str] = {
    "prompt_tokens": "Prompt tokens of finished requests",
    "generation_tokens": "Generated tokens of finished requests",
    "cached_tokens": "Prompt tokens served from the prefix cache",
    "num_requests": "Finished requests",
}

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    60.0,
    120.0,
)
_ITL_BUCKETS = (
    0.001,
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
)
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "time_to_first_token_seconds": ("Time to first token", _LATENCY_BUCKETS),
    "inter_token_latency_seconds": ("Time between two output tokens", _ITL_BUCKETS),
    "e2e_request_latency_seconds": ("Request latency from arrival to finish", _LATENCY_BUCKETS),
    "grammar_compilation_time_seconds": ("Grammar compilation time", _LATENCY_BUCKETS),
}


class ServerMetrics:
    """Prometheus metrics of one server; ``render()`` is the ``/metrics`` body."""

    def __init__(self, model_name: str = "default", *, prefix: str = "phloem") -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix {prefix!r}: expected one of {', '.join(PREFIXES)}")
        head = prefix + ":"
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self._gauges = {
            n: Gauge(head + n, h, labels, registry=reg).labels(model_name)
            for n, h in SCHEDULER_GAUGES.items()
        }
        counters = {**SCHEDULER_COUNTERS, **REQUEST_COUNTERS}
        self._counters = {
            n: Counter(head + n, h, labels, registry=reg).labels(model_name) for n, h in counters.items()
        }
        self._histograms = {
            n: Histogram(head + n, h, labels, buckets=b, registry=reg).labels(model_name)
            for n, (h, b) in HISTOGRAMS.items()
        }
        self._last_totals: dict[str, float] = {}
        fresh = {n: Gauge(head + n, h, labels, registry=reg).labels(model_name) for n, h in FRESHNESS_GAUGES.items()}
        self._stats_time = fresh["scheduler_stats_timestamp_seconds"]
        self._heartbeat_age = fresh["scheduler_heartbeat_age_seconds"]
        self.wall_clock: Callable[[], float] = time.time  # replaceable in tests
        self.watch_heartbeat(lambda: float("nan"))  # unknown until a heartbeat source is attached

    def watch_heartbeat(self, age: Callable[[], float]) -> None:
        """Read the heartbeat age gauge from ``age()`` (seconds) at every scrape."""
        self._heartbeat_age.set_function(age)

    def update_scheduler_stats(self, stats: Mapping[str, Any]) -> None:
        """Apply one stats dict from the scheduler.

        Gauge keys (``SCHEDULER_GAUGES``) are set; counter keys (``SCHEDULER_COUNTERS``) are
        cumulative totals since the scheduler started, and the counter advances by the increase
        since the previous dict (a total lower than before means the scheduler restarted: the new
        total is the increase). ``grammar_compilation_times`` (a list of seconds, optional) feeds its
        histogram. Unknown keys and ``None`` values are ignored. The stats timestamp becomes now.
        """
        self._stats_time.set(self.wall_clock())
        for name, gauge in self._gauges.items():
            value = stats.get(name)
            if value is not None:
                gauge.set(float(value))
        for name in SCHEDULER_COUNTERS:
            total = stats.get(name)
            if total is not None:
                self._advance_total(name, float(total))
        for seconds in stats.get("grammar_compilation_times") or ():
            self.observe_grammar_compilation(float(seconds))

    def _advance_total(self, name: str, total: float) -> None:
        last = self._last_totals.get(name, 0.0)
        delta = total - last if total >= last else total
        self._last_totals[name] = total
        if delta > 0:
            self._counters[name].inc(delta)

    def observe_request(
        self,
        ttft: float | None,
        itls: Sequence[float],
        e2e: float,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
    ) -> None:
        """Record one finished request (``ttft`` is None when no token was produced)."""
        if ttft is not None:
            self._histograms["time_to_first_token_seconds"].observe(ttft)
        itl = self._histograms["inter_token_latency_seconds"]
        for gap in itls:
            itl.observe(gap)
        self._histograms["e2e_request_latency_seconds"].observe(e2e)
        self._counters["num_requests"].inc()
        self._counters["prompt_tokens"].inc(max(prompt_tokens, 0))
        self._counters["generation_tokens"].inc(max(completion_tokens, 0))
        self._counters["cached_tokens"].inc(max(cached_tokens, 0))

    def observe_grammar_compilation(self, seconds: float) -> None:
        self._histograms["grammar_compilation_time_seconds"].observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
