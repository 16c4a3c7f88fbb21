"""An approximate prefix cache of one worker, kept by the router: a radix tree over request text.

The router never sees a worker's real KV cache; it remembers which texts it sent where. Text (not
tokens) keeps the router free of the tokenizer, and a shared text prefix is a shared token prefix
up to the last few tokens, which is all the routing decision needs. The tree holds at most
``max_chars`` characters: past that, the least recently used leaves go first, as a worker's own
cache evicts its least recently used prefixes.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable


class _Node:
    __slots__ = ("children", "key", "parent", "last_access")

    def __init__(self, key: str, parent: _Node | None, now: float) -> None:
        self.children: dict[str, _Node] = {}
        self.key = key  # the edge label from the parent
        self.parent = parent
        self.last_access = now


def _common_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case (a long shared prefix) in one C-level comparison
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class TextTree:
    """Character-level radix tree with a size cap and least-recently-used eviction."""

    def __init__(self, max_chars: int = 1 << 22, clock: Callable[[], float] = time.monotonic) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_chars = max_chars
        self.clock = clock
        self.root = _Node("", None, clock())
        self.size = 0  # characters stored on all edges

    def match(self, text: str) -> int:
        """Length of the longest prefix of ``text`` stored in the tree."""
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                return i
            k = _common_len(child.key, text[i : i + len(child.key)])
            i += k
            if k < len(child.key):
                return i
            node = child
        return i

    def insert(self, text: str) -> None:
        """Store ``text`` (its prefixes become recently used), then evict down to the cap."""
        now = self.clock()
        node, i = self.root, 0
        node.last_access = now
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                node.children[text[i]] = _Node(text[i:], node, now)
                self.size += len(text) - i
                break
            k = _common_len(child.key, text[i : i + len(child.key)])
            if k < len(child.key):  # split the edge where the texts part
                mid = _Node(child.key[:k], node, now)
                child.key = child.key[k:]
                child.parent = mid
                mid.children[child.key[0]] = child
                node.children[text[i]] = mid
                child = mid
            child.last_access = now
            node, i = child, i + k
        if self.size > self.max_chars:
            self._evict(self.max_chars)

    def clear(self) -> None:
        self.root = _Node("", None, self.clock())
        self.size = 0

    def _evict(self, target: int) -> None:
        """Drop least recently used leaves until at most ``target`` characters remain. A parent is
        never less recent than its children (every insert touches the whole path), so removing
        leaves in access order removes whole stale branches before any fresh one."""
        order = itertools.count()  # ties: first found first; nodes are not comparable
        heap = [(n.last_access, next(order), n) for n in self._leaves()]
        heapq.heapify(heap)
        while self.size > target and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.size -= len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, next(order), parent))

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out
