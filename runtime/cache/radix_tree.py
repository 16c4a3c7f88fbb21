"""Radix tree from token id sequences to KV slot indices.

A pure data structure: it knows nothing about requests, pools or allocators. Each node holds a run
of token ids (``key``) and the slot of each token (``value``, int64); the path from the root to a
node spells a cached prefix. Trees of different ``extra_key`` never share a node: the root's
children are keyed by ``(extra_key, first_token)``, every deeper level by ``first_token``.

Size accounting is per token: ``locked_size`` counts tokens of nodes with ``lock_ref > 0``,
``evictable_size`` the rest, and ``total_size`` is their sum. These count device-resident tokens only.

Tiers (hierarchical cache, optional). A node's KV lives on the device (``value``: device slots), on
the host (``host_value``: host-pool slots), or both; a node with neither is never in the tree. Along
any path from the root, device-resident nodes come first: once a node is host-only, so is every node
below it. Without a host tier every node is device-only and the tree behaves as a plain radix cache.
``host_size`` counts tokens that have a host copy (host-only or both).

Lifetimes: slot tensors returned by ``match_prefix`` / ``evict`` / ``all_slots`` are fresh tensors
the caller owns. A ``Node`` returned by ``match_prefix`` stays attached only while it is locked, or
until the next ``evict`` / ``reset``; splitting never detaches it (the node keeps standing for the
same full prefix, a new parent takes the upper part of its key).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from phloem.runtime.host_copy import to_host_async

__all__ = ["HostTier", "MatchResult", "Node", "RadixTree"]

_EMPTY = torch.empty(0, dtype=torch.int64)


class Node:
    """One run of tokens in the tree. Fields are managed by ``RadixTree``; treat them as read-only."""

    __slots__ = (
        "children", "parent", "key", "_value", "_ready", "host_value", "extra_key", "lock_ref",
        "last_access", "depth", "hit_count", "from_storage",
    )  # fmt: skip

    def __init__(
        self,
        *,
        key: tuple[int, ...],
        value: torch.Tensor | None,
        parent: Node | None,
        extra_key: str | None,
        depth: int,
        host_value: torch.Tensor | None = None,
    ) -> None:
        self.children: dict[Hashable, Node] = {}
        self.parent = parent
        self.key = key
        self._ready: Any = None  # event of the copy still filling ``_value`` (see ``value``)
        self.value = value  # int64 [len(key)] device slots, None when evicted to the host
        self.host_value = host_value  # int64 [len(key)] host-pool slots, None without a host copy
        self.extra_key = extra_key
        self.lock_ref = 0
        self.last_access = 0
        self.depth = depth  # tokens from the root to the end of this node
        self.hit_count = 0  # requests that created or reused this node (write policies)
        self.from_storage = False  # host copy read from the storage tier and not yet used

    @property
    def value(self) -> torch.Tensor | None:
        """The node's device slots (host int64 tensor). A value read back from the device
        (``to_host_async``) is waited for here, on first read, not when it was stored."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._value

    @value.setter
    def value(self, value: torch.Tensor | None) -> None:
        self._value, self._ready = value, None

    @property
    def value_ready(self) -> bool:
        """Whether reading :attr:`value` would return at once (no copy from the device pending)."""
        if self._ready is not None and self._ready.query():
            self._ready = None
        return self._ready is None

    def set_value_async(self, slots: torch.Tensor) -> None:
        """``value = slots`` (copied to the host) without waiting for a device tensor's copy."""
        self._value, self._ready = to_host_async(slots)

    @property
    def is_leaf(self) -> bool:
        """True when the node has no children."""
        return not self.children

    @property
    def on_device(self) -> bool:
        """The node's KV is in the device pool."""
        return self._value is not None

    @property
    def on_host(self) -> bool:
        """The node's KV has a copy in the host pool."""
        return self.host_value is not None

    @property
    def tier(self) -> str:
        """``"device"``, ``"host"`` or ``"both"``: where the node's KV lives."""
        if self._value is not None:
            return "both" if self.host_value is not None else "device"
        return "host"

    @property
    def is_device_leaf(self) -> bool:
        """On the device with no child on the device (the device tier's eviction frontier)."""
        return self._value is not None and not any(c._value is not None for c in self.children.values())

    def __repr__(self) -> str:
        head = list(self.key[:6]) + (["..."] if len(self.key) > 6 else [])
        return (
            f"Node(key={head}, len={len(self.key)}, lock_ref={self.lock_ref}, tier={self.tier}, "
            f"extra_key={self.extra_key!r})"
        )


class HostTier(Protocol):
    """What ``RadixTree.evict`` asks of a host tier when a device-resident node must go."""

    def backup(self, node: Node) -> bool:
        """Give ``node`` a host copy now (``RadixTree.set_host``); False when there is no room."""
        ...

    def free_host(self, slots: torch.Tensor) -> None:
        """Take back host-pool slots of nodes the tree dropped."""
        ...


@dataclass(frozen=True)
class MatchResult:
    """Longest cached prefix of a query.

    ``slots`` is a fresh int64 tensor of shape ``[length]`` (device slots); ``last_node`` is the
    deepest matched device-resident node (the root when nothing matched) and stands for exactly
    ``length`` tokens. With a host tier the match may go on through host-only nodes:
    ``host_length`` more tokens whose host-pool slots are ``host_slots``, ending at ``host_node``
    (``None`` when ``host_length == 0``).
    """

    slots: torch.Tensor
    last_node: Node
    length: int
    host_slots: torch.Tensor = field(default_factory=lambda: _EMPTY.clone())
    host_length: int = 0
    host_node: Node | None = None


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
        """Device-resident tokens in the tree."""
        return self._evictable_size + self._locked_size

    @property
    def host_size(self) -> int:
        """Tokens with a host copy (host-only or both)."""
        return self._host_size

    def reset(self) -> None:
        """Drop every node. All previously returned nodes become detached."""
        self._root = Node(key=(), value=_EMPTY, parent=None, extra_key=None, depth=0)
        self._root.lock_ref = 1  # the root is never evictable
        self._evictable_size = 0
        self._locked_size = 0
        self._host_size = 0

    # ------------------------------------------------------------------ lookup
    def match_prefix(self, key: Sequence[int], *, extra_key: str | None = None) -> MatchResult:
        """Find the longest cached prefix of ``key`` in the ``extra_key`` namespace.

        Mutates: splits the last node when the match ends inside it, and touches ``last_access`` of
        every node on the matched path. Returns a ``MatchResult`` (see its lifetime note).
        """
        key = _as_key(key)
        node, pos = self._root, 0
        values: list[torch.Tensor] = []
        host_values: list[torch.Tensor] = []
        device_node, device_pos = node, 0
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
            node, pos = child, pos + n
            if child._value is not None and not host_values:
                values.append(child.value)  # type: ignore[arg-type]  # not None: checked above
                device_node, device_pos = child, pos
            else:
                assert child.host_value is not None, "a node below a host-only node is on the device"
                host_values.append(child.host_value)
            if partial:
                break
        slots = torch.cat(values) if values else _EMPTY.clone()
        if not host_values:
            return MatchResult(slots=slots, last_node=device_node, length=device_pos)
        return MatchResult(
            slots=slots,
            last_node=device_node,
            length=device_pos,
            host_slots=torch.cat(host_values),
            host_length=pos - device_pos,
            host_node=node,
        )

    def find_node(self, key: Sequence[int], *, extra_key: str | None = None) -> Node | None:
        """The device node that ends exactly at the end of ``key`` (the root for an empty key), or
        None when the tree does not hold all of ``key`` on the device with a node boundary there.

        Reads no slot values (a node whose values are still being copied from the device is not
        waited for) and mutates nothing: for the node an ``insert`` of ``key`` just created."""
        key = _as_key(key)
        node, pos = self._root, 0
        while pos < len(key):
            child = node.children.get(self._edge(node, key[pos], extra_key))
            if child is None or child._value is None or len(child.key) > len(key) - pos:
                return None
            if _common_len(child.key, key, pos) < len(child.key):
                return None
            node, pos = child, pos + len(child.key)
        return node

    def insert(self, key: Sequence[int], slots: torch.Tensor, *, extra_key: str | None = None) -> int:
        """Insert ``key`` with per-token ``slots`` (int64, same length).

        Returns how many leading tokens were already cached on the device: their entries keep the
        tree's slots, so the caller's ``slots[:returned]`` that differ from the tree's are duplicates
        the caller must free. ``slots[returned:]`` are copied into the tree: into host-only nodes on
        the path (which become resident on both tiers) and into a new leaf (unlocked, so evictable).
        Mutates the tree (new leaf, possibly one split) and touches access times on the path.
        """
        key = _as_key(key)
        if slots.numel() != len(key):
            raise ValueError(f"key has {len(key)} tokens but slots has {slots.numel()}")
        node, pos, present = self._root, 0, None
        stamp = next(self._clock)
        while pos < len(key):
            child = node.children.get(self._edge(node, key[pos], extra_key))
            if child is None:
                break
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = stamp
            if child._value is None:  # host-only: the caller's slots make it device-resident again
                present = pos if present is None else present
                self.set_device(child, slots[pos : pos + n])
            node, pos = child, pos + n
        if pos < len(key):
            leaf = self._add_leaf(node, key[pos:], slots[pos:], extra_key, stamp)
            leaf.hit_count = 1
        return pos if present is None else present

    def insert_host(
        self, key: Sequence[int], host_slots: torch.Tensor, *, offset: int, extra_key: str | None = None
    ) -> int | None:
        """Insert ``key`` whose tokens from ``offset`` on have KV at ``host_slots`` (host pool).

        The tree must already hold ``key[:offset]`` (on any tier); returns ``None`` (and changes
        nothing) otherwise. Else returns how many leading tokens were already cached: the caller's
        ``host_slots[:returned - offset]`` (when positive) are duplicates it must free, the rest go
        into a new host-only leaf marked ``from_storage``. Mutates the tree (new leaf, possibly a split).
        """
        key = _as_key(key)
        if host_slots.numel() != len(key) - offset:
            raise ValueError(
                f"{len(key) - offset} tokens from offset {offset} but {host_slots.numel()} slots"
            )
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
        if pos < offset:
            return None
        if pos < len(key):
            value = (
                host_slots[pos - offset :].detach().reshape(-1).to(device="cpu", dtype=torch.int64).clone()
            )
            leaf = Node(key=key[pos:], value=None, parent=node, extra_key=extra_key,
                        depth=node.depth + len(key) - pos, host_value=value)  # fmt: skip
            leaf.last_access = stamp
            leaf.from_storage = True
            node.children[self._edge(node, key[pos], extra_key)] = leaf
            self._host_size += leaf.host_value.numel()  # type: ignore[union-attr]
        return pos

    # ------------------------------------------------------------------ tiers
    def set_host(self, node: Node, host_slots: torch.Tensor) -> None:
        """Record that ``node``'s KV now has a host copy at ``host_slots`` (int64 ``[len(node.key)]``)."""
        if node.host_value is not None:
            raise RuntimeError(f"{node!r} already has a host copy")
        if host_slots.numel() != len(node.key):
            raise ValueError(f"node has {len(node.key)} tokens but {host_slots.numel()} host slots")
        node.host_value = host_slots.detach().reshape(-1).to(device="cpu", dtype=torch.int64).clone()
        self._host_size += len(node.key)

    def drop_host(self, node: Node) -> torch.Tensor:
        """Forget the host copy of a node that is also on the device; returns its host slots."""
        if node.host_value is None or node._value is None:
            raise RuntimeError(f"{node!r} must be on both tiers to drop its host copy")
        slots, node.host_value = node.host_value, None
        self._host_size -= slots.numel()
        return slots

    def set_device(self, node: Node, slots: torch.Tensor) -> None:
        """Make a host-only node device-resident at ``slots`` (after its KV was loaded there).

        Its tokens count as locked or evictable according to its ``lock_ref``.
        """
        if node._value is not None:
            raise RuntimeError(f"{node!r} is already on the device")
        if slots.numel() != len(node.key):
            raise ValueError(f"node has {len(node.key)} tokens but {slots.numel()} slots")
        if node.parent is not self._root and node.parent is not None and node.parent._value is None:
            raise RuntimeError("load a path from the top: the parent of a device node must be on the device")
        node.set_value_async(slots)
        node.from_storage = False
        if node.lock_ref > 0:
            self._locked_size += len(node.key)
        else:
            self._evictable_size += len(node.key)

    def path_to(self, node: Node) -> list[Node]:
        """Nodes from the root's child down to ``node`` (root excluded)."""
        path = []
        while node is not self._root and node is not None:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        return path[::-1]

    # ------------------------------------------------------------------ locking
    def lock(self, node: Node) -> None:
        """Add one lock to ``node`` and every ancestor; locked nodes are never evicted.

        Mutates ``lock_ref`` on the path and moves newly locked tokens from evictable to locked.
        """
        self._check_attached(node)
        while node is not self._root:
            if node.lock_ref == 0 and node._value is not None:
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
            if node.lock_ref == 0 and node._value is not None:
                self._evictable_size += len(node.key)
                self._locked_size -= len(node.key)
            node = node.parent  # type: ignore[assignment]

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int, *, host: HostTier | None = None) -> torch.Tensor:
        """Free device slots of unlocked nodes, least recently used first, until ``num_tokens`` are freed.

        Candidates are unlocked device leaves (no child on the device); a parent that becomes one
        is a candidate in turn. A candidate with a host copy, or one ``host.backup`` gives a copy,
        is demoted to host-only and stays in the tree; any other is removed together with its
        host-only subtree, whose host slots go to ``host.free_host``. Without a host tier this is
        plain LRU leaf eviction. Returns the freed device slots as one int64 tensor: at least
        ``num_tokens`` when that many are evictable, else every evictable slot. The caller owns the
        result and must give the slots back to its allocator.
        Cost: O(nodes) to collect candidates plus O(k log k) for the k nodes evicted.
        """
        if num_tokens <= 0:
            return _EMPTY.clone()
        order = itertools.count()
        heap = [
            (n.last_access, next(order), n) for n in self._nodes() if n.lock_ref == 0 and n.is_device_leaf
        ]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        count = 0
        while count < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            value = node.value
            assert value is not None
            freed.append(value)
            count += value.numel()
            parent = node.parent
            assert parent is not None
            if node.host_value is not None or (host is not None and host.backup(node)):
                node.value = None
                self._evictable_size -= len(node.key)
            else:
                dropped = self._remove_subtree(node)
                if dropped.numel() and host is not None:
                    host.free_host(dropped)
            if parent is not self._root and parent.lock_ref == 0 and parent.is_device_leaf:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return torch.cat(freed) if freed else _EMPTY.clone()

    def evict_host(self, num_tokens: int, *, protect: Node | None = None) -> torch.Tensor:
        """Free host slots until ``num_tokens`` are freed; returns them (the caller frees them).

        First removes unlocked host-only leaves, least recently used first (a parent left as one is
        next); then, if still short, drops the host copies of unlocked nodes that are also on the
        device (they stay in the tree). ``protect`` and its ancestors are never touched.
        """
        if num_tokens <= 0:
            return _EMPTY.clone()
        kept = set(map(id, self.path_to(protect))) if protect is not None else set()
        order = itertools.count()
        heap = [
            (n.last_access, next(order), n)
            for n in self._nodes()
            if n._value is None and n.is_leaf and n.lock_ref == 0 and id(n) not in kept
        ]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        count = 0
        while count < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert node.host_value is not None and parent is not None
            self._remove_leaf(node)
            freed.append(node.host_value)
            count += node.host_value.numel()
            if (parent is not self._root and parent._value is None and parent.is_leaf
                    and parent.lock_ref == 0 and id(parent) not in kept):  # fmt: skip
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        if count < num_tokens:
            both = sorted(
                (n for n in self._nodes()
                 if n._value is not None and n.host_value is not None and n.lock_ref == 0 and id(n) not in kept),
                key=lambda n: n.last_access,
            )  # fmt: skip
            for node in both:
                if count >= num_tokens:
                    break
                slots = self.drop_host(node)
                freed.append(slots)
                count += slots.numel()
        return torch.cat(freed) if freed else _EMPTY.clone()

    # ------------------------------------------------------------------ inspection
    def all_slots(self) -> torch.Tensor:
        """Every device slot held by the tree, as a fresh int64 tensor (order unspecified)."""
        values = [v for n in self._nodes() if (v := n.value) is not None]
        return torch.cat(values) if values else _EMPTY.clone()

    def all_host_slots(self) -> torch.Tensor:
        """Every host-pool slot held by the tree, as a fresh int64 tensor (order unspecified)."""
        values = [n.host_value for n in self._nodes() if n.host_value is not None]
        return torch.cat(values) if values else _EMPTY.clone()

    def recount(self) -> tuple[int, int]:
        """Recompute ``(evictable_size, locked_size)`` from the nodes (for integrity checks)."""
        evictable = locked = 0
        for n in self._nodes():
            if n._value is None:
                continue
            if n.lock_ref > 0:
                locked += len(n.key)
            else:
                evictable += len(n.key)
        return evictable, locked

    def tier_problems(self) -> list[str]:
        """Structural faults of the tiers (empty when sound): a node with no copy, a slot tensor of
        the wrong length, a device node under a host-only one, or a wrong ``host_size``."""
        problems, host = [], 0
        for n in self._nodes():
            if n._value is None and n.host_value is None:
                problems.append(f"{n!r} has no copy on any tier")
            for name, v in (("value", n.value), ("host_value", n.host_value)):
                if v is not None and v.numel() != len(n.key):
                    problems.append(f"{n!r}.{name} has {v.numel()} slots for {len(n.key)} tokens")
            if n._value is not None and n.parent is not self._root and n.parent._value is None:  # type: ignore[union-attr]
                problems.append(f"{n!r} is on the device below a host-only node")
            host += 0 if n.host_value is None else len(n.key)
        if host != self._host_size:
            problems.append(f"host_size {self._host_size} != recount {host}")
        return problems

    def pretty_print(self, *, max_tokens: int = 8) -> str:
        """The tree as indented text, one node per line (also printed). Mutates nothing."""
        lines = [f"<root> total={self.total_size} evictable={self.evictable_size} locked={self.locked_size}"]
        stack = [(c, 1) for c in reversed(list(self._root.children.values()))]
        while stack:
            node, level = stack.pop()
            toks = list(node.key[:max_tokens]) + (["..."] if len(node.key) > max_tokens else [])
            ns = f" extra_key={node.extra_key!r}" if node.extra_key is not None and level == 1 else ""
            tier = "" if node.tier == "device" else f" tier={node.tier}"
            lines.append(f"{'  ' * level}{toks} len={len(node.key)} lock_ref={node.lock_ref}{ns}{tier}")
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
        value, host_value = child.value, child.host_value
        upper = Node(
            key=child.key[:n],
            value=None if value is None else value[:n].clone(),
            parent=parent,
            extra_key=child.extra_key,
            depth=child.depth - len(child.key) + n,
            host_value=None if host_value is None else host_value[:n].clone(),
        )
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hit_count = child.hit_count
        upper.from_storage = child.from_storage
        parent.children[self._edge(parent, child.key[0], child.extra_key)] = upper
        child.key, child.parent = child.key[n:], upper
        child.value = None if value is None else value[n:].clone()
        child.host_value = None if host_value is None else host_value[n:].clone()
        upper.children[child.key[0]] = child
        return upper

    def _add_leaf(
        self, parent: Node, key: tuple[int, ...], slots: torch.Tensor, extra_key: str | None, stamp: int
    ) -> Node:
        leaf = Node(key=key, value=None, parent=parent, extra_key=extra_key, depth=parent.depth + len(key))
        leaf.set_value_async(slots)  # a finished request's device row: no wait for the stream
        leaf.last_access = stamp
        parent.children[self._edge(parent, key[0], extra_key)] = leaf
        self._evictable_size += len(key)
        return leaf

    def _remove_leaf(self, node: Node) -> Node:
        parent = node.parent
        assert parent is not None and node.is_leaf and node.lock_ref == 0
        del parent.children[self._edge(parent, node.key[0], node.extra_key)]
        node.parent = None
        if node._value is not None:
            self._evictable_size -= len(node.key)
        if node.host_value is not None:
            self._host_size -= len(node.key)
        return parent

    def _remove_subtree(self, node: Node) -> torch.Tensor:
        """Remove an unlocked node whose descendants are all host-only and unlocked; returns the
        host slots of every removed node (the node's own device slots are the caller's to free)."""
        host: list[torch.Tensor] = []
        stack, order = [node], []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # leaves first
            assert n.lock_ref == 0 and (n is node or n._value is None)
            if n.host_value is not None:
                host.append(n.host_value)
            self._remove_leaf(n)
        return torch.cat(host) if host else _EMPTY.clone()

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
