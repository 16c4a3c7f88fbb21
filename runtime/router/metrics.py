"""The router's Prometheus metrics (its own registry: a router process may also host other code)."""

from __future__ import annotations

from phloem.runtime.router.worker import Worker
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 (re-exported)
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class RouterMetrics:
    def __init__(self, prefix: str = "phloem_router") -> None:
        reg = self.registry = CollectorRegistry()
        self.requests = Counter(f"{prefix}_requests", "Requests received, by route", ["route"], registry=reg)
        self.errors = Counter(
            f"{prefix}_errors", "Requests answered with an error >= 500 (from the router or a worker)",
            ["route"], registry=reg,
        )  # fmt: skip
        self.retries = Counter(f"{prefix}_retries", "Requests resent to another worker", registry=reg)
        self.no_worker = Counter(
            f"{prefix}_no_healthy_worker", "Requests refused: no worker healthy", registry=reg
        )
        self.healthy_workers = Gauge(f"{prefix}_healthy_workers", "Workers taking requests", registry=reg)
        w = ["worker"]
        self.worker_requests = Counter(
            f"{prefix}_worker_requests", "Requests sent to the worker", w, registry=reg
        )
        self.worker_errors = Counter(
            f"{prefix}_worker_errors", "Failed connections, failed streams and answers >= 500 of the worker",
            w, registry=reg,
        )  # fmt: skip
        self.worker_in_flight = Gauge(
            f"{prefix}_worker_in_flight", "Requests in flight on the worker", w, registry=reg
        )
        self.worker_cache_hits = Counter(
            f"{prefix}_worker_cache_aware_hits",
            "Requests routed to the worker by a prefix match",
            w,
            registry=reg,
        )
        self.worker_healthy = Gauge(
            f"{prefix}_worker_healthy", "1 while the worker takes requests", w, registry=reg
        )

    def add_worker(self, worker: Worker) -> None:
        """Create the worker's series at zero, so a dashboard sees it before its first request."""
        for metric in (self.worker_requests, self.worker_errors, self.worker_cache_hits):
            metric.labels(worker.url)
        self.worker_in_flight.labels(worker.url).set(0)
        self.worker_healthy.labels(worker.url).set(int(worker.healthy))

    def render(self) -> bytes:
        return generate_latest(self.registry)
