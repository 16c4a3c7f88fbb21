"""Cache manager: the request lifecycle on top of the radix tree and the slot allocator.

The radix tree and the allocator know nothing of requests; this class holds the protocol a scheduler
follows for each request, with a ``CacheHandle`` as the request's side of it:

    m = cm.match(tokens, extra_key=k, max_len=prompt_len - 1)   # longest cached prefix
    handle = cm.acquire(m, extra_key=k)                         # lock it; handle.prefix_len = m.length
    req_to_token[row, :m.length] = m.slots                      # caller fills its row
    new = cm.alloc(extend_len)                                  # may evict unlocked leaves; None = no room
    ...  forward pass  ...
    cm.cache_unfinished(handle, tokens, req_to_token[row, :kv_len], req_row=row)   # after each chunk
    ...  decode  ...
    cm.cache_finished(handle, tokens, req_to_token[row, :allocated])                # on finish
    cm.release(handle, req_to_token[row, :allocated])                              # or on abort/retract

Slot ownership, per request row ``[0, allocated)``:

    [0, handle.prefix_len)          tree's slots, protected by the lock on handle.node
    [handle.prefix_len, allocated)  private slots, owned by the request until cache_* / release

Invariant (``check_integrity``): free + evictable + locked + private == total, and no slot is free and
in the tree at once. With ``tree=None`` (``--disable-radix-cache``) nothing is shared: every slot a
request holds is private and is freed when it finishes.

Hierarchical cache (``hicache``, optional): ``match`` also reports a continuation of the prefix held
only on the host (``Match.host_length``) and starts storage prefetches past it; a scheduler that
wants those tokens asks ``prefetch_ready(m)`` before admitting and calls ``m = load_back(m)`` right
before ``acquire`` (fresh device slots, KV copied from the host). ``record_hit(m)`` on first
admission returns ``{device, host, storage}`` token counts. The invariant then also covers the host
tier: host free + host-resident == host total (``check_integrity``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from phloem.runtime.host_copy import to_device

from .allocator import TokenSlotAllocator
from .radix_tree import Node, RadixTree

if TYPE_CHECKING:
    from .hicache import HiCacheController

__all__ = ["CacheHandle", "CacheIntegrityError", "CacheManager", "Match"]

_EMPTY = torch.empty(0, dtype=torch.int64)


class CacheIntegrityError(AssertionError):
    """The pool invariant does not hold."""


@dataclass(frozen=True)
class Match:
    """A cached prefix: ``slots`` (fresh int64 ``[length]``) and the tree node ending it.

    ``node`` is ``None`` when the radix cache is disabled. It is safe to use only until the next
    ``alloc`` / ``flush`` unless locked first (``acquire`` or ``lock``).

    With a host tier: ``host_length`` more tokens of the prefix live only on the host, ending at
    ``host_node``; ``prefetch`` is a storage prefetch for tokens past them (or ``None``).
    After ``load_back``, ``loaded_host`` / ``loaded_storage`` of the ``length`` tokens were just
    brought back from the host (``loaded_storage`` of those had been read from storage).
    """

    slots: torch.Tensor
    length: int
    node: Node | None
    host_length: int = 0
    host_node: Node | None = None
    prefetch: Any = None
    loaded_host: int = 0
    loaded_storage: int = 0

    @property
    def cached_tokens_details(self) -> dict[str, int]:
        """Cached tokens of this match by the tier they were found on."""
        device = self.length - self.loaded_host - self.loaded_storage
        return {"device": device, "host": self.loaded_host, "storage": self.loaded_storage}


@dataclass
class CacheHandle:
    """The request's side of the cache protocol; ``CacheManager`` updates it in place.

    ``node`` is the tree node this request holds a lock on (``None``: no lock held) and
    ``prefix_len`` the number of leading positions of the request's row whose slots belong to the
    tree (the rest of the row is the request's own).
    """

    extra_key: str | None = None
    node: Node | None = None
    prefix_len: int = 0


EVICT_CHUNK_DIVISOR = 64  # an eviction frees at least 1/64 of the pool (when that much is evictable)


class CacheManager:
    """Request lifecycle over a ``RadixTree`` (or none) and a ``TokenSlotAllocator``.

    Parameters
    ----------
    allocator:
        Slot allocator of the KV pool.
    req_to_token:
        The caller's ``[rows, max_context]`` int64 table; only ``cache_unfinished`` writes to it.
    tree:
        Radix tree, or ``None`` to disable prefix sharing.
    hicache:
        Hierarchical cache controller over the same ``tree`` (host and storage tiers), or ``None``.
    """

    def __init__(
        self,
        *,
        allocator: TokenSlotAllocator,
        req_to_token: torch.Tensor,
        tree: RadixTree | None,
        hicache: HiCacheController | None = None,
    ) -> None:
        if hicache is not None and (tree is None or hicache.tree is not tree):
            raise ValueError("the hierarchical cache needs the radix tree it was built over")
        self._allocator = allocator
        self._req_to_token = req_to_token
        self._tree = tree
        self._hicache = hicache

    # ------------------------------------------------------------------ sizes
    @property
    def tree(self) -> RadixTree | None:
        """The radix tree, for read-only inspection (``prefix_walk``); None without prefix sharing."""
        return self._tree

    @property
    def radix_enabled(self) -> bool:
        """Whether prefixes are shared (a tree is present)."""
        return self._tree is not None

    @property
    def evictable_size(self) -> int:
        """Tokens in unlocked tree nodes (freeable on demand)."""
        return self._tree.evictable_size if self._tree is not None else 0

    @property
    def locked_size(self) -> int:
        """Tokens in tree nodes locked by running requests."""
        return self._tree.locked_size if self._tree is not None else 0

    @property
    def free_size(self) -> int:
        """Slots on the allocator's free list."""
        return self._allocator.available_size

    @property
    def available_size(self) -> int:
        """Slots ``alloc`` can hand out now: free plus evictable."""
        return self._allocator.available_size + self.evictable_size

    @property
    def total_size(self) -> int:
        """Usable slots in the pool."""
        return self._allocator.total_size

    @property
    def hicache(self) -> HiCacheController | None:
        """The hierarchical cache controller, if enabled."""
        return self._hicache

    # ------------------------------------------------------------------ admission
    def match(
        self, token_ids: Sequence[int], *, extra_key: str | None = None, max_len: int | None = None
    ) -> Match:
        """Longest cached prefix of ``token_ids[:max_len]``.

        The scheduler passes ``max_len = prompt_len - 1`` (at least one token must be computed to
        get logits) or ``logprob_start_len`` when input logprobs are wanted. Mutates the tree (split,
        access times) but locks nothing: call ``acquire`` before the next ``alloc``.
        """
        if self._tree is None:
            return Match(slots=_EMPTY.clone(), length=0, node=None)
        key = token_ids if max_len is None else token_ids[: max(max_len, 0)]
        if self._hicache is not None:
            self._hicache.poll()
        r = self._tree.match_prefix(key, extra_key=extra_key)
        if self._hicache is None:
            return Match(slots=r.slots, length=r.length, node=r.last_node)
        op = self._hicache.lookup(key, extra_key=extra_key, cached=r.length + r.host_length)
        return Match(slots=r.slots, length=r.length, node=r.last_node, host_length=r.host_length,
                     host_node=r.host_node, prefetch=op)  # fmt: skip

    def prefetch_ready(self, match: Match | None) -> bool:
        """Whether a request with this match may be admitted now: False only while a storage
        prefetch for it is running and the prefetch policy says to wait for it."""
        if self._hicache is None or match is None:
            return True
        return self._hicache.prefetch_ready(match.prefetch)

    def load_back(self, match: Match) -> Match:
        """Bring the host-only part of ``match`` into fresh device slots; returns the longer match.

        Call it right before ``acquire`` (nothing may allocate in between). The device part and the
        host path are protected while slots are allocated (which may evict other nodes); when the
        pool cannot hold the host part, ``match`` is returned unchanged and the request computes
        those tokens. Returns ``match`` itself when there is nothing on the host.
        """
        if self._hicache is None or match.host_length == 0 or match.host_node is None:
            return match
        assert self._tree is not None
        end = match.host_node
        self._tree.lock(end)
        try:
            slots = self.alloc(match.host_length)
            if slots is None:
                return match
            nodes = self._tree.path_to(end)[-_count_host_only(end) :]
            host, storage = self._hicache.load(nodes, slots)
        finally:
            self._tree.unlock(end)
        return Match(
            slots=torch.cat([match.slots, slots]),
            length=match.length + match.host_length,
            node=end,
            loaded_host=match.loaded_host + host,
            loaded_storage=match.loaded_storage + storage,
        )

    def record_hit(self, match: Match) -> dict[str, int]:
        """Count an admitted request's cached tokens per tier; returns ``{device, host, storage}``."""
        details = match.cached_tokens_details
        if self._hicache is not None:
            self._hicache.record_hit(**details)
        return details

    def reset_counters(self) -> None:
        """Zero the hierarchical cache's counters (no-op without it)."""
        if self._hicache is not None:
            self._hicache.reset_counters()

    def tier_stats(self) -> dict[str, float]:
        """Hierarchical cache counters (hits per tier, bytes moved); empty when it is disabled."""
        return self._hicache.stats() if self._hicache is not None else {}

    def acquire(self, match: Match, *, extra_key: str | None = None) -> CacheHandle:
        """Lock ``match.node`` and return the request's handle (``prefix_len = match.length``).

        After this the caller writes ``match.slots`` into its row at ``[0, match.length)``.
        """
        self.lock(match.node)
        if self._hicache is not None and match.length > 0:
            self._hicache.on_acquire(match.node)
        return CacheHandle(extra_key=extra_key, node=match.node, prefix_len=match.length)

    def lock(self, node: Node | None) -> None:
        """Lock ``node`` and its ancestors against eviction (no-op for ``None``)."""
        if node is not None and self._tree is not None:
            self._tree.lock(node)

    def unlock(self, node: Node | None) -> None:
        """Undo one ``lock(node)`` (no-op for ``None``)."""
        if node is not None and self._tree is not None:
            self._tree.unlock(node)

    def alloc(self, n: int) -> torch.Tensor | None:
        """Allocate ``n`` slots, evicting unlocked tree leaves (LRU) if the free list is short.

        Returns an int64 ``[n]`` tensor the caller owns (private slots), or ``None`` with nothing
        evicted when even full eviction could not free enough. Lock every node still needed first.
        """
        if n > self.available_size:
            return None
        short = n - self._allocator.available_size
        if short > 0 and self._tree is not None:
            # evict at least a chunk: an eviction walks the whole tree, and once the pool is full
            # of cached prefixes every decode step would otherwise evict its few tokens anew
            chunk = max(short, self._allocator.total_size // EVICT_CHUNK_DIVISOR)
            self._allocator.free(self._tree.evict(chunk, host=self._hicache))
        return self._allocator.alloc(n)

    def free_slots(self, slots: torch.Tensor) -> None:
        """Give private slots back to the allocator (e.g. unused speculative or aborted slots)."""
        self._allocator.free(slots)

    # ------------------------------------------------------------------ progress
    def cache_unfinished(
        self,
        handle: CacheHandle,
        token_ids: Sequence[int],
        slots: torch.Tensor,
        *,
        req_row: int,
        kv_len: int | None = None,
    ) -> tuple[Node | None, int]:
        """Put the first ``kv_len`` computed tokens into the tree while the request keeps running.

        ``slots`` is the request's row ``[0, >= kv_len)`` (may be a view of ``req_to_token``);
        ``kv_len`` defaults to ``len(slots)``. Duplicates of slots already in the tree are freed and
        ``req_to_token[req_row, :kv_len]`` is rewritten to the tree's slots; the new last node is locked
        before the old one is unlocked. Updates ``handle`` (``prefix_len = kv_len``) and returns
        ``(handle.node, handle.prefix_len)``. Slots past ``kv_len`` stay private.
        With the radix cache disabled this changes nothing.
        """
        if self._tree is None:
            return handle.node, handle.prefix_len
        kv_len = self._kv_len(handle, token_ids, slots, kv_len)
        present = self._insert_and_free_duplicates(handle, token_ids, slots, kv_len)
        start = handle.prefix_len
        if present > start:
            # Tokens [start, present) were in the tree already (another request computed them):
            # the row must point at the tree's slots, its own were freed as duplicates.
            m = self._tree.match_prefix(token_ids[:present], extra_key=handle.extra_key)
            self._req_to_token[req_row, start:present] = to_device(m.slots[start:], self._req_to_token.device)
        # The rest of the row is what went into the tree. Finding the node reads no slot values,
        # so the new leaf's copy from the device is not waited for (no stream sync).
        last = self._tree.find_node(token_ids[:kv_len], extra_key=handle.extra_key)
        if last is None:
            raise RuntimeError(f"no tree node ends at the {kv_len} tokens just inserted")
        if self._hicache is not None:
            self._hicache.on_insert(last)
        self._tree.lock(last)
        self.unlock(handle.node)
        handle.node, handle.prefix_len = last, kv_len
        return handle.node, handle.prefix_len

    def cache_finished(
        self,
        handle: CacheHandle,
        token_ids: Sequence[int],
        slots: torch.Tensor,
        *,
        kv_len: int | None = None,
    ) -> None:
        """Retire a finished request: cache its computed tokens and give back what it held.

        ``slots`` is every slot in the request's row (``[0, allocated)``); KV exists for the first
        ``kv_len`` of them (default all) and ``token_ids[:kv_len]`` are their tokens (prompt plus
        output, never the last sampled token, whose KV was not computed). Inserts those tokens,
        frees duplicate slots and slots past ``kv_len``, and unlocks ``handle.node``. Afterwards the
        caller drops its row (it may reference freed slots); ``handle`` is cleared.
        With the radix cache disabled, frees every private slot.
        """
        if self._tree is None:
            self._allocator.free(slots[handle.prefix_len :])
        else:
            kv_len = self._kv_len(handle, token_ids, slots, kv_len)
            self._insert_and_free_duplicates(handle, token_ids, slots, kv_len)
            self._allocator.free(slots[kv_len:])
            if self._hicache is not None and kv_len > 0:
                # find_node reads no slot values: the new leaf's copy from the device is not waited for
                last = self._tree.find_node(token_ids[:kv_len], extra_key=handle.extra_key)
                if last is None:  # no node boundary at kv_len (never after an insert of kv_len tokens)
                    last = self._tree.match_prefix(token_ids[:kv_len], extra_key=handle.extra_key).last_node
                self._hicache.on_insert(last)
            self.unlock(handle.node)
        handle.node, handle.prefix_len = None, 0

    def release(self, handle: CacheHandle, slots: torch.Tensor) -> None:
        """Abort or retract without caching: free the private slots ``slots[prefix_len:]`` and unlock.

        ``slots`` is the request's row ``[0, allocated)``. The tree keeps its part (now evictable);
        ``handle`` is cleared and the caller drops its row.
        """
        self._allocator.free(slots[handle.prefix_len :])
        self.unlock(handle.node)
        handle.node, handle.prefix_len = None, 0

    # ------------------------------------------------------------------ maintenance
    def flush(self) -> bool:
        """Empty the tree and reset the allocator, but only when nothing is held by a request.

        Returns False (and changes nothing) while any node is locked or any private slot is out.
        All earlier ``Match`` nodes and slot tensors become stale on success.
        """
        if self.locked_size > 0 or self.free_size + self.evictable_size != self.total_size:
            return False
        if self._tree is not None:
            self._tree.reset()
        self._allocator.reset()
        if self._hicache is not None:
            self._hicache.flush()
        return True

    def close(self) -> None:
        """Stop the hierarchical cache's threads after finishing queued storage writes (no-op without)."""
        if self._hicache is not None:
            self._hicache.close()

    def check_integrity(self, *, private: int | torch.Tensor = 0) -> None:
        """Raise ``CacheIntegrityError`` unless free + evictable + locked + private == total.

        ``private`` is the number (or the tensor) of slots held privately by running requests
        (``allocated - prefix_len`` summed over them); 0 when idle, where also locked must be 0
        unless a caller still holds a lock. With a tensor, also checks those slots are neither free
        nor in the tree. Always checks the tree's size counters, that slots are unique, and that no
        slot is both free and in the tree. Mutates nothing visible; O(pool size).
        """
        n_private = private if isinstance(private, int) else int(private.numel())
        free = self._allocator.free_slots()
        tree = self._tree.all_slots() if self._tree is not None else _EMPTY
        total = free.numel() + self.evictable_size + self.locked_size + n_private
        _require(
            total == self.total_size,
            f"free {free.numel()} + evictable {self.evictable_size} + "
            f"locked {self.locked_size} + private {n_private} != total {self.total_size}",
        )
        if self._tree is not None:
            counted = self._tree.recount()
            _require(
                counted == (self.evictable_size, self.locked_size),
                f"tree counters {(self.evictable_size, self.locked_size)} != recount {counted}",
            )
        parts = [free, tree] + ([] if isinstance(private, int) else [private.reshape(-1).cpu()])
        everything = torch.cat(parts)
        _require(bool(((everything >= 1) & (everything <= self.total_size)).all()), "slot out of range")
        # a count per slot, not a sort: linear in the pool (millions of slots on a GPU)
        _require(
            everything.numel() == 0 or int(torch.bincount(everything).max()) <= 1,
            "a slot is held twice (free and in the tree, or duplicated)",
        )
        if self._hicache is not None:
            problems = self._hicache.integrity_problems()
            _require(not problems, "; ".join(problems))

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _kv_len(
        handle: CacheHandle, token_ids: Sequence[int], slots: torch.Tensor, kv_len: int | None
    ) -> int:
        kv_len = slots.numel() if kv_len is None else kv_len
        if not handle.prefix_len <= kv_len <= min(slots.numel(), len(token_ids)):
            raise ValueError(
                f"kv_len {kv_len} must lie in [prefix_len {handle.prefix_len}, "
                f"min(len(slots) {slots.numel()}, len(token_ids) {len(token_ids)})]"
            )
        return kv_len

    def _insert_and_free_duplicates(
        self, handle: CacheHandle, token_ids: Sequence[int], slots: torch.Tensor, kv_len: int
    ) -> int:
        """Insert ``token_ids[:kv_len]``; free the request's own slots for tokens the tree already
        had. Returns how many leading tokens the tree had (``RadixTree.insert``)."""
        assert self._tree is not None
        key = token_ids[:kv_len]
        present = self._tree.insert(key, slots[:kv_len], extra_key=handle.extra_key)
        if present > handle.prefix_len:
            self._allocator.free(slots[handle.prefix_len : present])
        return present


def _count_host_only(node: Node) -> int:
    """How many nodes at the bottom of the path to ``node`` are host-only."""
    n = 0
    while node is not None and node.value is None:
        n += 1
        node = node.parent  # type: ignore[assignment]
    return n


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise CacheIntegrityError(message)
