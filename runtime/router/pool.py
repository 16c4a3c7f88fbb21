"""The workers behind the router: health checks, and the bookkeeping around each routed request.

A worker is taken out after ``health_failure_threshold`` failed checks in a row, or at once when
a request cannot reach it (refused or dropped connection); it is put back on its first passing
check. Its remembered cache is forgotten when it goes out: a worker that comes back was usually
restarted, its KV cache empty.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp
from phloem.runtime.router.metrics import RouterMetrics
from phloem.runtime.router.policy import Choice, Policy
from phloem.runtime.router.worker import Worker

logger = logging.getLogger("phloem.router")


class NoHealthyWorker(Exception):
    pass


class WorkerPool:
    def __init__(self, urls: Sequence[str], policy: Policy, metrics: RouterMetrics) -> None:
        self.workers = [Worker(url) for url in urls]
        self.policy = policy
        self.metrics = metrics
        for w in self.workers:
            metrics.add_worker(w)
        metrics.healthy_workers.set(0)

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy]

    def by_url(self, url: str) -> Worker | None:
        return next((w for w in self.workers if w.url == url), None)

    # ---- routing -------------------------------------------------------------------------------
    def route(self, texts: Sequence[str], tokens: int, exclude: Sequence[Worker] = ()) -> Choice:
        """Pick a healthy worker (not in ``exclude``) and count the request on it."""
        candidates = [w for w in self.workers if w.healthy and w not in exclude]
        if not candidates:
            raise NoHealthyWorker
        choice = self.policy.choose(candidates, texts)
        w = choice.worker
        w.in_flight += 1
        w.in_flight_tokens += tokens
        w.requests += 1
        self.metrics.worker_requests.labels(w.url).inc()
        self.metrics.worker_in_flight.labels(w.url).set(w.in_flight)
        if choice.cache_hit:
            w.cache_hits += 1
            self.metrics.worker_cache_hits.labels(w.url).inc()
        return choice

    def done(self, w: Worker, tokens: int) -> None:
        w.in_flight -= 1
        w.in_flight_tokens -= tokens
        self.metrics.worker_in_flight.labels(w.url).set(w.in_flight)

    def failed(self, w: Worker, reason: str, *, unreachable: bool) -> None:
        """A request on ``w`` failed; ``unreachable``: the worker could not be reached (or dropped
        the connection), so it is taken out until a health check passes."""
        w.errors += 1
        w.last_error = reason
        self.metrics.worker_errors.labels(w.url).inc()
        if unreachable:
            self.mark_down(w, reason)

    # ---- health --------------------------------------------------------------------------------
    def mark_down(self, w: Worker, reason: str) -> None:
        w.last_error = reason
        if not w.healthy:
            return
        w.healthy = False
        self.policy.forget(w.url)
        self._publish(w)
        logger.warning(
            "worker %s is out: %s (%d of %d healthy)", w.url, reason, len(self.healthy()), len(self.workers)
        )

    def mark_up(self, w: Worker) -> None:
        w.failed_checks = 0
        if w.healthy:
            return
        w.healthy = True
        w.last_error = ""
        self._publish(w)
        logger.info("worker %s is healthy (%d of %d healthy)", w.url, len(self.healthy()), len(self.workers))

    def _publish(self, w: Worker) -> None:
        self.metrics.worker_healthy.labels(w.url).set(int(w.healthy))
        self.metrics.healthy_workers.set(len(self.healthy()))

    async def check(self, session: aiohttp.ClientSession, w: Worker, timeout: float, threshold: int) -> None:
        """One health check of ``w``: ``GET /health``."""
        try:
            async with session.get(w.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                ok, reason = resp.status == 200, f"/health answered {resp.status}"
                await resp.read()
        except aiohttp.ClientConnectorError as exc:  # nothing listens: out at once
            self.mark_down(w, f"connection refused ({exc.os_error or exc})")
            return
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            ok, reason = False, f"/health failed: {type(exc).__name__} {exc}".strip()
        if ok:
            self.mark_up(w)
            return
        w.failed_checks += 1
        w.last_error = reason
        if w.failed_checks >= threshold:
            self.mark_down(w, reason)

    async def check_all(self, session: aiohttp.ClientSession, timeout: float, threshold: int) -> None:
        await asyncio.gather(*(self.check(session, w, timeout, threshold) for w in self.workers))

    async def watch(
        self, session: aiohttp.ClientSession, interval: float, timeout: float, threshold: int
    ) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.check_all(session, timeout, threshold)
            except Exception:  # a bug in one round must not end the checks
                logger.exception("health check round failed")
