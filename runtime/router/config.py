"""``RouterArgs``: the options of ``phloem router`` (and of the router ``phloem serve --dp-size``
runs), each a ``--flag`` of the same name."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from phloem.runtime.router import policy as policies
from phloem.runtime.router.worker import normalize_url


def _opt(default: Any, help: str, choices: tuple | None = None, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, **extra})


@dataclass(frozen=True)
class RouterArgs:
    worker_urls: tuple[str, ...] = _opt((), "the phloem serve workers (http://host:port ...)", nargs="+")
    host: str = _opt("127.0.0.1", "address to bind")
    port: int = _opt(30000, "port to bind")
    policy: str = _opt("cache_aware", "how a worker is picked", policies.POLICIES)
    load_balance_method: str = _opt(
        "requests", "load of a worker: in-flight requests, or their estimated tokens", policies.LOAD_METHODS
    )
    cache_threshold: float = _opt(
        policies.DEFAULT_CACHE_THRESHOLD,
        "cache_aware: follow a prefix match that covers more than this fraction of the request text",
    )
    balance_abs_threshold: int = _opt(
        policies.DEFAULT_BALANCE_ABS_THRESHOLD,
        "cache_aware: ignore the cache when the busiest worker's load exceeds the idlest's by more than this ...",
    )
    balance_rel_threshold: float = _opt(
        policies.DEFAULT_BALANCE_REL_THRESHOLD, "... and is more than this many times the idlest's"
    )
    max_tree_chars: int = _opt(
        policies.DEFAULT_MAX_TREE_CHARS, "cache_aware: characters of text remembered per worker (LRU beyond)"
    )
    health_check_interval: float = _opt(2.0, "seconds between two health checks of each worker")
    health_check_timeout: float = _opt(5.0, "seconds a worker's /health may take")
    health_failure_threshold: int = _opt(
        2,
        "consecutive failed health checks that take a worker out (a refused connection takes it out at once)",
    )
    api_key: str | None = _opt(
        None, "bearer token clients must send (all routes but /health and /metrics); also sent to the workers"
    )
    log_level: str = _opt("info", "log level", ("debug", "info", "warning", "error"))

    def __repr__(self) -> str:  # never show the key
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "api_key"}
        return f"RouterArgs({shown})"

    def replace(self, **changes: Any) -> RouterArgs:
        return dataclasses.replace(self, **changes)

    def check(self) -> RouterArgs:
        """The same args with worker URLs normalized; ``ValueError`` naming the flag otherwise."""
        if not self.worker_urls:
            raise ValueError("--worker-urls: give at least one worker")
        urls = tuple(normalize_url(u) for u in self.worker_urls)
        if len(set(urls)) != len(urls):
            raise ValueError("--worker-urls: a worker is listed twice")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("--balance-abs-threshold must be >= 0 and --balance-rel-threshold >= 1")
        if self.max_tree_chars < 1:
            raise ValueError(f"--max-tree-chars must be >= 1, got {self.max_tree_chars}")
        if not self.health_check_interval > 0 or not self.health_check_timeout > 0:
            raise ValueError("--health-check-interval and --health-check-timeout must be > 0 seconds")
        if self.health_failure_threshold < 1:
            raise ValueError(f"--health-failure-threshold must be >= 1, got {self.health_failure_threshold}")
        return self.replace(worker_urls=urls)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata["help"], "dest": f.name}
            if f.metadata["choices"]:
                kwargs["choices"] = f.metadata["choices"]
            if "nargs" in f.metadata:
                kwargs["nargs"] = f.metadata["nargs"]
                kwargs["required"] = True
            elif f.default is not None:
                kwargs["type"] = type(f.default)
            parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> RouterArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(ns).items() if k in names}
        values["worker_urls"] = tuple(values.get("worker_urls") or ())
        return cls(**values)
