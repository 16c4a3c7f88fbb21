"""Routing policies: which healthy worker takes a request.

``cache_aware`` keeps one ``TextTree`` per worker of the texts sent there. A request goes to the
worker whose tree holds the longest prefix of its text when that prefix covers more than
``cache_threshold`` of the text (that worker holds the prefix's KV cache and skips its prefill),
else to the least loaded worker. When loads are far apart, cache locality is ignored and the least
loaded worker is taken: a replica with a long queue delays every request more than a recomputed
prefix costs. ``round_robin`` and ``shortest_queue`` ignore the text.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from phloem.runtime.router.tree import TextTree
from phloem.runtime.router.worker import Worker

POLICIES = ("cache_aware", "round_robin", "shortest_queue")
LOAD_METHODS = ("requests", "total_tokens")

# More than half of the text already cached on one worker: its prefill work is at most half of a
# cold one, and the texts that share a long system prompt or few-shot block (the case this policy
# exists for) are well above it, while unrelated texts that share a few words are well below.
DEFAULT_CACHE_THRESHOLD = 0.5
# Loads are "uneven" only when both gaps hold: an absolute gap of more than 16 in-flight requests
# (a replica batches dozens of requests at once, so a few more cost little next to a recomputed
# prefix) and a relative gap of 2x (16 more on a replica already running 200 is noise).
DEFAULT_BALANCE_ABS_THRESHOLD = 16
DEFAULT_BALANCE_REL_THRESHOLD = 2.0
DEFAULT_MAX_TREE_CHARS = 1 << 22  # 4M characters per worker: about 1M tokens, tens of MB of router memory


@dataclass(frozen=True)
class Choice:
    worker: Worker
    cache_hit: bool = False  # chosen for a prefix match
    matched: int = 0  # characters of the text found in the chosen worker's tree


class Policy:
    name = "base"

    def choose(self, workers: Sequence[Worker], texts: Sequence[str]) -> Choice:
        """Pick one of ``workers`` (all healthy, at least one) for a request of ``texts`` (empty
        for requests without a prompt; several for a batch, which goes to one worker whole)."""
        raise NotImplementedError

    def forget(self, url: str) -> None:
        """The worker's cache is gone (it went down, or was flushed)."""

    def reset(self) -> None:
        """Every worker's cache was flushed."""


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, workers: Sequence[Worker], texts: Sequence[str]) -> Choice:
        return Choice(workers[next(self._turn) % len(workers)])


class ShortestQueuePolicy(Policy):
    name = "shortest_queue"

    def __init__(self, load_method: str = "requests") -> None:
        self.load_method = load_method

    def choose(self, workers: Sequence[Worker], texts: Sequence[str]) -> Choice:
        return Choice(min(workers, key=lambda w: w.load(self.load_method)))


class CacheAwarePolicy(Policy):
    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
        balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
        load_method: str = "requests",
        max_tree_chars: int = DEFAULT_MAX_TREE_CHARS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.load_method = load_method
        self.max_tree_chars = max_tree_chars
        self.clock = clock
        self.trees: dict[str, TextTree] = {}

    def tree(self, url: str) -> TextTree:
        if url not in self.trees:
            self.trees[url] = TextTree(self.max_tree_chars, self.clock)
        return self.trees[url]

    def uneven(self, workers: Sequence[Worker]) -> bool:
        loads = [w.load(self.load_method) for w in workers]
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def choose(self, workers: Sequence[Worker], texts: Sequence[str]) -> Choice:
        text = texts[0] if texts else ""
        choice = self._pick(workers, text)
        tree = self.tree(choice.worker.url)
        for t in texts:
            if t:
                tree.insert(t)
        return choice

    def _pick(self, workers: Sequence[Worker], text: str) -> Choice:
        def least_loaded() -> Worker:
            # ties go to the worker caching the least text: new prefixes spread over the replicas
            return min(workers, key=lambda w: (w.load(self.load_method), self.tree(w.url).size))

        if not text or self.uneven(workers):
            return Choice(least_loaded())
        matches = [(self.tree(w.url).match(text), w) for w in workers]
        best = max(m for m, _ in matches)
        if best / len(text) > self.cache_threshold:
            tied = [w for m, w in matches if m == best]
            worker = min(tied, key=lambda w: w.load(self.load_method))
            return Choice(worker, cache_hit=True, matched=best)
        worker = least_loaded()
        return Choice(worker, matched=dict((w.url, m) for m, w in matches)[worker.url])

    def forget(self, url: str) -> None:
        self.trees.pop(url, None)

    def reset(self) -> None:
        self.trees.clear()


def make_policy(
    name: str,
    *,
    load_method: str = "requests",
    cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
    balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
    balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
    max_tree_chars: int = DEFAULT_MAX_TREE_CHARS,
) -> Policy:
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "shortest_queue":
        return ShortestQueuePolicy(load_method)
    if name == "cache_aware":
        return CacheAwarePolicy(
            cache_threshold, balance_abs_threshold, balance_rel_threshold, load_method, max_tree_chars
        )
    raise ValueError(f"--policy {name}: expected one of {', '.join(POLICIES)}")
