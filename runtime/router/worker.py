"""What the router knows of one worker: its address, health and load, and its counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Worker:
    url: str
    healthy: bool = False  # until its first health check passes
    in_flight: int = 0  # requests sent and not yet answered in full
    in_flight_tokens: int = 0  # their estimated prompt + output tokens
    requests: int = 0
    errors: int = 0  # failed connections, failed streams, answers >= 500
    cache_hits: int = 0  # requests routed here by a prefix match
    failed_checks: int = 0  # consecutive failed health checks
    last_error: str = ""

    def load(self, method: str) -> int:
        return self.in_flight_tokens if method == "total_tokens" else self.in_flight

    def describe(self) -> dict[str, object]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "in_flight_tokens": self.in_flight_tokens,
            "requests": self.requests,
            "errors": self.errors,
            "cache_hits": self.cache_hits,
            "last_error": self.last_error,
        }


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port``."""
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("--worker-urls: an empty URL")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--worker-urls {url}: expected an http:// or https:// URL")
    return url
