"""Radix tree from token id sequences to KV slot indices.

A pure data structure: it knows nothing about requests, pools or allocators. Each node holds a run
of token ids (``key``) and the slot of each token (``value``, int64); the path from the root to a
node spells a cached prefix. Trees of different ``extra_key`` never share a node: the root's
children are keyed by ``(extra_key, first_token)``, every deeper level by ``first_token``.

Size accounting is per token: ``locked_size`` counts tokens of nodes with ``lock_ref > 0``,
``evictable_size`` the rest, and ``total_size`` is their sum.

Lifetimes: slot tensors returned by ``match_prefix`` / ``evict`` / ``all_slots`` are fresh tensors
the caller owns. A ``Node`` returned by ``match_prefix`` stays attached only while it is locked, or
until the next ``evict`` / ``reset``; splitting never detaches it (the node keeps standing for the
same full prefix, a new parent takes the upper part of its key).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["MatchResult", "Node", "RadixTree"]

_EMPTY = torch.empty(0, dtype=torch.int64)


class Node:
    """One run of tokens in the tree. Fields are managed by ``RadixTree``; treat them as read-only."""

    __slots__ = ("children", "parent", "key", "value", "extra_key", "lock_ref", "last_access", "depth")

    def __init__(
        self,
        *,
        key: tuple[int, ...],
        value: torch.Tensor,
        parent: Node | None,
        extra_key: str | None,
        depth: int,
    ) -> None:
        self.children: dict[Hashable, Node] = {}
        self.parent = parent
        self.key = key
        self.value = value  # int64 [len(key)]
        self.extra_key = extra_key
        self.lock_ref = 0
        self.last_access = 0
        self.depth = depth  # tokens from the root to the end of this node

    @property
    def is_leaf(self) -> bool:
        """True when the node has no children."""
        return not self.children

    def __repr__(self) -> str:
        head = list(self.key[:6]) + (["..."] if len(self.key) > 6 else [])
        return (
            f"Node(key={head}, len={len(self.key)}, lock_ref={self.lock_ref}, extra_key={self.extra_key!r})"
        )


@dataclass(frozen=True)
class MatchResult:
    """Longest cached prefix of a query.

    ``slots`` is a fresh int64 tensor of shape ``[length]``; ``last_node`` is the deepest matched node
    (the root when nothing matched) and stands for exactly ``length`` tokens.
    """

    slots: torch.Tensor
    last_node: Node
    length: int


class RadixTree:
    """Prefix tree over token ids with per-token slot values, locking and LRU eviction."""

    def __init__(self) -> None:
        self._clock = itertools.count(1)
        self.reset()

    # ------------------------------------------------------------------ sizes
    @property
    def root(self) -> Node:
        """The root node (empty key, never evicted, never counted)."""
        return self._root

    @property
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes."""
        return self._evictable_size

    @property
    def locked_size(self) -> int:
        """Tokens in nodes with ``lock_ref > 0``."""
        return self._locked_size

    @property
    def total_size(self) -> int:
        """Tokens in the tree."""
        return self._evictable_size + self._locked_size

    def reset(self) -> None:
        """Drop every node. All previously returned nodes become detached."""
        self._root = Node(key=(), value=_EMPTY, parent=None, extra_key=None, depth=0)
        self._root.lock_ref = 1  # the root is never evictable
        self._evictable_size = 0
        self._locked_size = 0

    # ------------------------------------------------------------------ lookup
    def match_prefix(self, key: Sequence[int], *, extra_key: str | None = None) -> MatchResult:
        """Find the longest cached prefix of ``key`` in the ``extra_key`` namespace.

        Mutates: splits the last node when the match ends inside it, and touches ``last_access`` of
        every node on the matched path. Returns a ``MatchResult`` (see its lifetime note).
        """
        key = _as_key(key)
        node, pos, values = self._root, 0, []
        stamp = next(self._clock)
        while pos < len(key):
            child = node.children.get(self._edge(node, key[pos], extra_key))
            if child is None:
                break
            n = _common_len(child.key, key, pos)
            partial = n < len(child.key)
            if partial:
                child = self._split(child, n)
            child.last_access = stamp
            values.append(child.value)
            node, pos = child, pos + n
            if partial:
                break
        slots = torch.cat(values) if values else _EMPTY.clone()
        return MatchResult(slots=slots, last_node=node, length=pos)

    def insert(self, key: Sequence[int], slots: torch.Tensor, *, extra_key: str | None = None) -> int:
        """Insert ``key`` with per-token ``slots`` (int64, same length).

        Returns how many leading tokens were already cached: their entries keep the tree's slots, so
        the caller's ``slots[:returned]`` that differ from the tree's are duplicates the caller must
        free. ``slots[returned:]`` are copied into new nodes (unlocked, so evictable).
        Mutates the tree (new leaf, possibly one split) and touches access times on the path.
        """
        key = _as_key(key)
        if slots.numel() != len(key):
            raise ValueError(f"key has {len(key)} tokens but slots has {slots.numel()}")
        node, pos = self._root, 0
        stamp = next(self._clock)
        while pos < len(key):
            child = node.children.get(self._edge(node, key[pos], extra_key))
            if child is None:
                break
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = stamp
            node, pos = child, pos + n
        if pos < len(key):
            self._add_leaf(node, key[pos:], slots[pos:], extra_key, stamp)
        return pos

    # ------------------------------------------------------------------ locking
    def lock(self, node: Node) -> None:
        """Add one lock to ``node`` and every ancestor; locked nodes are never evicted.

        Mutates ``lock_ref`` on the path and moves newly locked tokens from evictable to locked.
        """
        self._check_attached(node)
        while node is not self._root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._locked_size += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        """Remove one lock from ``node`` and every ancestor (the inverse of ``lock``)."""
        self._check_attached(node)
        while node is not self._root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_size += len(node.key)
                self._locked_size -= len(node.key)
            node = node.parent  # type: ignore[assignment]

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Remove unlocked leaves, least recently used first, until ``num_tokens`` slots are freed.

        A parent left as an unlocked leaf becomes a candidate in turn. Returns the freed slots as one
        int64 tensor: at least ``num_tokens`` of them when that many are evictable, else every
        evictable slot. The caller owns the result and must give the slots back to its allocator.
        Cost: O(nodes) to collect leaves plus O(k log k) for the k nodes evicted.
        """
        if num_tokens <= 0:
            return _EMPTY.clone()
        order = itertools.count()
        heap = [(n.last_access, next(order), n) for n in self._nodes() if n.is_leaf and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        count = 0
        while count < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = self._remove_leaf(node)
            freed.append(node.value)
            count += node.value.numel()
            if parent is not self._root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return torch.cat(freed) if freed else _EMPTY.clone()

    # ------------------------------------------------------------------ inspection
    def all_slots(self) -> torch.Tensor:
        """Every slot held by the tree, as a fresh int64 tensor (order unspecified)."""
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else _EMPTY.clone()

    def recount(self) -> tuple[int, int]:
        """Recompute ``(evictable_size, locked_size)`` from the nodes (for integrity checks)."""
        evictable = locked = 0
        for n in self._nodes():
            if n.lock_ref > 0:
                locked += len(n.key)
            else:
                evictable += len(n.key)
        return evictable, locked

    def pretty_print(self, *, max_tokens: int = 8) -> str:
        """The tree as indented text, one node per line (also printed). Mutates nothing."""
        lines = [f"<root> total={self.total_size} evictable={self.evictable_size} locked={self.locked_size}"]
        stack = [(c, 1) for c in reversed(list(self._root.children.values()))]
        while stack:
            node, level = stack.pop()
            toks = list(node.key[:max_tokens]) + (["..."] if len(node.key) > max_tokens else [])
            ns = f" extra_key={node.extra_key!r}" if node.extra_key is not None and level == 1 else ""
            lines.append(f"{'  ' * level}{toks} len={len(node.key)} lock_ref={node.lock_ref}{ns}")
            stack.extend((c, level + 1) for c in reversed(list(node.children.values())))
        text = "\n".join(lines)
        print(text)
        return text

    # ------------------------------------------------------------------ internals
    def _edge(self, parent: Node, token: int, extra_key: str | None) -> Hashable:
        return (extra_key, token) if parent is self._root else token

    def _nodes(self) -> Iterator[Node]:
        """Every node except the root, depth first."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _split(self, child: Node, n: int) -> Node:
        """Cut ``child`` after ``n`` tokens; returns the new upper node, ``child`` keeps the rest.

        Sizes do not change: the upper node inherits ``lock_ref`` and ``last_access``.
        """
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = Node(
            key=child.key[:n],
            value=child.value[:n].clone(),
            parent=parent,
            extra_key=child.extra_key,
            depth=child.depth - len(child.key) + n,
        )
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[self._edge(parent, child.key[0], child.extra_key)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:].clone(), upper
        upper.children[child.key[0]] = child
        return upper

    def _add_leaf(
        self, parent: Node, key: tuple[int, ...], slots: torch.Tensor, extra_key: str | None, stamp: int
    ) -> None:
        value = slots.detach().reshape(-1).to(device="cpu", dtype=torch.int64).clone()
        leaf = Node(key=key, value=value, parent=parent, extra_key=extra_key, depth=parent.depth + len(key))
        leaf.last_access = stamp
        parent.children[self._edge(parent, key[0], extra_key)] = leaf
        self._evictable_size += len(key)

    def _remove_leaf(self, node: Node) -> Node:
        parent = node.parent
        assert parent is not None and node.is_leaf and node.lock_ref == 0
        del parent.children[self._edge(parent, node.key[0], node.extra_key)]
        node.parent = None
        self._evictable_size -= len(node.key)
        return parent

    def _check_attached(self, node: Node) -> None:
        probe = node
        while probe.parent is not None:
            probe = probe.parent
        if probe is not self._root:
            raise RuntimeError(f"{node!r} is no longer in the tree (evicted or reset)")


def _as_key(key: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    if isinstance(key, torch.Tensor):
        return tuple(key.tolist())
    return key if isinstance(key, tuple) else tuple(key)


def _common_len(node_key: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
    """Length of the common prefix of ``node_key`` and ``key[pos:]``."""
    n = min(len(node_key), len(key) - pos)
    if key[pos : pos + n] == node_key[:n]:
        return n
    i = 0
    while i < n and node_key[i] == key[pos + i]:
        i += 1
    return i
