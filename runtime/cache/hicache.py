"""Hierarchical KV cache controller (docs/design.md §3, HiCache): device -> host -> storage.

The radix tree records where each node's KV lives (device, host or both); this controller moves it
between tiers and decides when. The ``CacheManager`` calls it at fixed points of a request's life:

    match      poll finished storage prefetches into the host tier; look up pages past the tree's match
    load       host-only nodes of a matched path -> fresh device slots (before the request locks them);
               on CUDA the copy is staged at once and lands layer by layer during the forward pass
               of the next batch launched, which waits for layer l before its attention of layer l
    acquire    count a hit on the path (write_through_selective backs up at the second hit)
    insert     after a request's tokens enter the tree (write_through backs up at the first hit)
    evict      a device leaf without a host copy: write_back backs it up, the others drop it

Write policies (when a device node gets its host copy):

    write_through             when the node is created (first hit)
    write_through_selective   when a second request reuses it
    write_back                when it is evicted from the device

Eviction order is device -> host -> dropped: a device-evicted node with a host copy stays in the tree
as host-only; the host tier evicts host-only leaves in LRU order, then host copies of nodes that are
also on the device. Every node that gets a host copy also sends its full pages to the storage tier
(if any), asynchronously; a later match that runs past the tree into stored pages prefetches them on a
thread (hits shorter than ``prefetch_threshold`` tokens are not worth it), and the prefetch policy
says how long a request waits for it:

    best_effort     never waits: the request runs with whatever arrived
    wait_complete   waits until the prefetch finished
    timeout         waits until it finished or ``timeout_base_s + timeout_per_1k_s x tokens / 1024`` passed

Threads: the tree, pools and counters are touched only on the caller's (scheduler) thread; storage
reads run on a prefetch thread and return page tensors, inserted by ``poll`` on the caller's thread.
Device KV whose load has not landed yet is never copied back to the host or to storage (the copier
says which slots are ``landing``; such a backup is skipped).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .host_pool import HostKVPool, KVCopier, make_copier
from .kv_pool import KVPool
from .radix_tree import Node, RadixTree
from .storage import STORAGE_BACKENDS, KVStorage, page_hashes

__all__ = [
    "HiCacheConfig",
    "HiCacheController",
    "PREFETCH_POLICIES",
    "PrefetchOp",
    "WRITE_POLICIES",
    "build_hicache",
]

logger = logging.getLogger("phloem.cache")

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
_BACKUP_AT_HITS = {"write_through": 1, "write_through_selective": 2, "write_back": None}


@dataclass(frozen=True)
class HiCacheConfig:
    """Policies of the hierarchical cache (see the module docstring)."""

    write_policy: str = "write_through"
    prefetch_policy: str = "timeout"
    prefetch_threshold: int = 256
    prefetch_timeout_base_s: float = 1.0
    prefetch_timeout_per_1k_s: float = 0.25

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy {self.write_policy!r} is not one of {WRITE_POLICIES}")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch policy {self.prefetch_policy!r} is not one of {PREFETCH_POLICIES}")

    def prefetch_timeout(self, num_tokens: int) -> float:
        """Seconds a ``timeout`` prefetch of ``num_tokens`` may hold its request back."""
        return self.prefetch_timeout_base_s + self.prefetch_timeout_per_1k_s * num_tokens / 1024


@dataclass(eq=False)
class PrefetchOp:
    """Pages being read from storage for a prefix: tokens ``[start, end)`` of ``tokens``."""

    tokens: tuple[int, ...]
    extra_key: str | None
    start: int
    future: Future[list[tuple[torch.Tensor, torch.Tensor]]]
    deadline: float
    timed_out: bool = False
    inserted: int = 0  # tokens that reached the host tier when it finished

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) - self.start


@dataclass
class _Counters:
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    backed_up_tokens: int = 0
    loaded_tokens: int = 0
    evicted_to_host_tokens: int = 0
    prefetched_tokens: int = 0
    prefetch_ops: int = 0
    prefetch_timeouts: int = 0
    prefetch_dropped_tokens: int = 0
    bytes_device_to_host: int = 0
    bytes_host_to_device: int = 0


class HiCacheController:
    """Moves KV between the device pool, a host pool and an optional storage tier.

    Parameters
    ----------
    tree:
        The cache manager's radix tree (the controller updates node tiers through its methods).
    device_pool, host_pool:
        Where KV lives on each tier.
    config:
        Write and prefetch policies.
    storage:
        The storage tier, or ``None``.
    model_id:
        Model identity, part of every storage key.
    copier:
        Device <-> host copy engine (default: chosen from the device pool's device).
    clock:
        Monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self,
        *,
        tree: RadixTree,
        device_pool: KVPool,
        host_pool: HostKVPool,
        config: HiCacheConfig = HiCacheConfig(),
        storage: KVStorage | None = None,
        model_id: str = "",
        copier: KVCopier | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tree = tree
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.cfg = config
        self.storage = storage
        self.model_id = model_id
        self.copier = copier or make_copier(device_pool)
        self.clock = clock
        self.counters = _Counters()
        self._backup_at = _BACKUP_AT_HITS[config.write_policy]
        self._bytes_per_token = host_pool.bytes_per_token
        self._ops: dict[str, PrefetchOp] = {}
        self._pending: dict[int, Node] = {}  # id -> node due for a backup once its slots land
        self._reader = (
            ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-prefetch") if storage else None
        )

    # ================================================================== write policies
    def on_insert(self, node: Node) -> None:
        """A request's tokens now end at ``node``: back up path nodes that reached the hit threshold."""
        if self._backup_at is None:
            return
        self._backup_pending()
        for n in self.tree.path_to(node):
            if n.hit_count >= self._backup_at:
                self._backup_soon(n)

    def on_acquire(self, node: Node | None) -> None:
        """A request reuses the path to ``node``: count the hit, back up what reached the threshold."""
        if node is None:
            return
        for n in self.tree.path_to(node):
            n.hit_count += 1
            if self._backup_at is not None and n.hit_count >= self._backup_at:
                self._backup_soon(n)

    def _backup_soon(self, node: Node) -> None:
        """Back ``node`` up now if its slot numbers are on the host, else at the next chance.

        A finished request's slots come back from the device asynchronously
        (``Node.set_value_async``); reading them at once would wait for the forward pass in
        flight and leave the GPU idle until the scheduler's next launch. Such nodes wait in
        ``_pending`` until their copy has landed (``_backup_pending``, run on every insert, hit
        and poll), or until eviction reaches them (``backup``)."""
        if node.host_value is not None or not node.on_device:
            return
        if node.value_ready:
            self.backup_node(node)
        else:
            self._pending[id(node)] = node

    def _backup_pending(self) -> None:
        """Back up the pending nodes whose slot numbers have landed; drop those that no longer need it.

        A pending node may have been split meanwhile (another request matched part of it): the
        upper part is a new node, so the whole path is checked again."""
        for key, n in list(self._pending.items()):
            if n.host_value is not None or not n.on_device:
                del self._pending[key]
            elif n.value_ready:
                del self._pending[key]
                assert self._backup_at is not None  # only write-through policies queue nodes
                for m in self.tree.path_to(n):
                    if m.hit_count >= self._backup_at:
                        self._backup_soon(m)

    # ------------------------------------------------------------------ HostTier (called by evict)
    def backup(self, node: Node) -> bool:
        """A device leaf without a host copy is being evicted: keep it on the host when the policy
        says so (write_back), or when host-only nodes hang below it (they need their parent)."""
        if self._pending.pop(id(node), None) is not None:  # due for write-through already
            return self.backup_node(node)
        if self.cfg.write_policy != "write_back" and node.is_leaf:
            return False
        if self.backup_node(node):
            self.counters.evicted_to_host_tokens += len(node.key)
            return True
        return False

    def free_host(self, slots: torch.Tensor) -> None:
        """Host slots of nodes the tree dropped go back to the host allocator."""
        self.host_pool.allocator.free(slots)

    # ------------------------------------------------------------------ copies
    def backup_node(self, node: Node) -> bool:
        """Copy a device node to fresh host slots (evicting host-only leaves if needed) and send its
        full pages to storage. False, with nothing changed, when the host pool cannot hold it."""
        assert node.value is not None and node.host_value is None
        if self.copier.landing(node.value):  # its KV is still on the way from the host
            return False
        slots = self.alloc_host(len(node.key))
        if slots is None:
            return False
        self.copier.to_host(self.device_pool, node.value, self.host_pool, slots)
        self.tree.set_host(node, slots)
        self.counters.backed_up_tokens += len(node.key)
        self.counters.bytes_device_to_host += len(node.key) * self._bytes_per_token
        self._store_pages(node)
        return True

    def alloc_host(self, n: int, *, protect: Node | None = None) -> torch.Tensor | None:
        """``n`` host slots, evicting from the host tier if the free list is short; ``None`` if it
        cannot hold them. ``protect`` and its ancestors are kept."""
        alloc = self.host_pool.allocator
        if n > alloc.total_size:
            return None
        short = n - alloc.available_size
        if short > 0:
            alloc.free(self.tree.evict_host(short, protect=protect))
        return alloc.alloc(n)

    def load(self, nodes: Sequence[Node], dev_slots: torch.Tensor) -> tuple[int, int]:
        """Copy host-only ``nodes`` (a path, top first) into ``dev_slots`` and make them
        device-resident. Returns ``(tokens from host, tokens that came from storage)``.

        The KV is visible to every forward pass launched after this call (on CUDA with a model
        runner: it lands during the first one, see ``host_pool.LayerwiseLoader``)."""
        host_slots = torch.cat([n.host_value for n in nodes])  # type: ignore[misc]
        assert host_slots.numel() == dev_slots.numel()
        self.copier.to_device(self.host_pool, host_slots, self.device_pool, dev_slots)
        from_storage, pos = 0, 0
        for n in nodes:
            if n.from_storage:
                from_storage += len(n.key)
            self.tree.set_device(n, dev_slots[pos : pos + len(n.key)])
            pos += len(n.key)
        self.counters.loaded_tokens += pos
        self.counters.bytes_host_to_device += pos * self._bytes_per_token
        return pos - from_storage, from_storage

    def record_hit(self, *, device: int, host: int, storage: int) -> None:
        """Count the cached prompt tokens of an admitted request by the tier they came from."""
        self.counters.device_hit_tokens += device
        self.counters.host_hit_tokens += host
        self.counters.storage_hit_tokens += storage

    # ================================================================== storage
    def _namespace(self, extra_key: str | None) -> str:
        return f"{self.model_id}\x00{extra_key or ''}"

    def _store_pages(self, node: Node) -> None:
        """Queue the pages that end inside ``node`` for the storage tier."""
        if self.storage is None:
            return
        size = self.storage.page_size
        start, end = node.depth - len(node.key), node.depth
        first, last = start // size, end // size  # pages first .. last-1 end inside (start, end]
        if first >= last:
            return
        path = self.tree.path_to(node)
        if any(n.host_value is None and n.value is not None and self.copier.landing(n.value) for n in path):
            return  # _gather would read device KV that has not landed yet
        tokens = [t for n in path for t in n.key]
        keys = page_hashes(tokens, page_size=size, namespace=self._namespace(node.extra_key), limit=last)
        for i in range(first, last):
            if not self.storage.exists(keys[i]):
                k, v = self._gather(path, i * size, (i + 1) * size)
                self.storage.put(keys[i], k, v)

    def _gather(self, path: Sequence[Node], lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[layers, hi - lo, kv_heads, head_dim]`` of positions ``[lo, hi)`` of a path,
        from the host copy where there is one, else from the device."""
        ks, vs, pos = [], [], 0
        for n in path:
            a, b = max(lo, pos), min(hi, pos + len(n.key))
            if a < b:
                if n.host_value is not None:
                    k, v = self.host_pool.read(n.host_value[a - pos : b - pos])
                else:
                    assert n.value is not None
                    d = n.value[a - pos : b - pos].to(self.device_pool.device)
                    k = torch.stack([buf[d] for buf in self.device_pool.k_buffer]).to(
                        "cpu", self.host_pool.dtype
                    )
                    v = torch.stack([buf[d] for buf in self.device_pool.v_buffer]).to(
                        "cpu", self.host_pool.dtype
                    )
                ks.append(k)
                vs.append(v)
            pos += len(n.key)
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1)

    def lookup(self, tokens: Sequence[int], *, extra_key: str | None, cached: int) -> PrefetchOp | None:
        """Stored pages continuing a prefix the tree holds ``cached`` tokens of: starts (or finds) a
        prefetch when they add at least ``prefetch_threshold`` tokens, else ``None``."""
        if self.storage is None:
            return None
        size = self.storage.page_size
        num_pages, first = len(tokens) // size, cached // size
        if num_pages * size - cached < self.cfg.prefetch_threshold:
            return None
        keys = page_hashes(tokens, page_size=size, namespace=self._namespace(extra_key), limit=num_pages)
        end = first
        while end < num_pages and self.storage.exists(keys[end]):
            end += 1
        if end * size - cached < self.cfg.prefetch_threshold:
            return None
        op = self._ops.get(keys[end - 1])
        if op is not None:
            return op
        assert self._reader is not None
        storage = self.storage
        wanted = keys[first:end]

        def read() -> list[tuple[torch.Tensor, torch.Tensor]]:
            pages = []
            for key in wanted:  # a prefix is useful only up to its first missing or corrupt page
                page = storage.get(key)
                if page is None:
                    break
                pages.append(page)
            return pages

        op = PrefetchOp(
            tokens=tuple(tokens[: end * size]),
            extra_key=extra_key,
            start=first * size,
            future=self._reader.submit(read),
            deadline=self.clock() + self.cfg.prefetch_timeout(end * size - cached),
        )
        self._ops[keys[end - 1]] = op
        self.counters.prefetch_ops += 1
        return op

    def prefetch_ready(self, op: PrefetchOp | None) -> bool:
        """Whether a request waiting on ``op`` may be scheduled now (per the prefetch policy).

        An ``op`` that finished after its request's match was taken has just put pages into the host
        tier that the match does not show: False, so the request is matched again first.
        """
        if op is None:
            return True
        if op.future.done():
            self.poll()
            return op.inserted == 0
        policy = self.cfg.prefetch_policy
        if policy == "best_effort":
            return True
        if policy == "timeout" and self.clock() >= op.deadline:
            if not op.timed_out:
                op.timed_out = True
                self.counters.prefetch_timeouts += 1
            return True
        return False

    def poll(self) -> None:
        """Insert finished prefetches into the host tier (as host-only nodes marked from storage);
        back up the pending nodes whose slot numbers have landed."""
        self._backup_pending()
        for name, op in [(k, o) for k, o in self._ops.items() if o.future.done()]:
            del self._ops[name]
            try:
                pages = op.future.result()
            except Exception:  # a read error is a miss
                logger.exception("KV storage prefetch failed")
                pages = []
            if pages:
                self._insert_pages(op, pages)

    def _insert_pages(self, op: PrefetchOp, pages: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        n = len(pages) * pages[0][0].shape[1]
        key = op.tokens[: op.start + n]
        m = self.tree.match_prefix(key[: op.start], extra_key=op.extra_key)
        anchor = m.host_node or m.last_node
        if m.length + m.host_length < op.start:  # the prefix left the tree meanwhile
            self.counters.prefetch_dropped_tokens += n
            return
        self.tree.lock(anchor)
        slots = self.alloc_host(n, protect=anchor)
        self.tree.unlock(anchor)
        if slots is None:
            self.counters.prefetch_dropped_tokens += n
            return
        k = torch.cat([p[0] for p in pages], dim=1)
        v = torch.cat([p[1] for p in pages], dim=1)
        self.copier.wait_host_reads()  # the slots may have just been freed under a copy still reading them
        self.host_pool.write(slots, k, v)
        present = self.tree.insert_host(key, slots, offset=op.start, extra_key=op.extra_key)
        if present is None:
            self.host_pool.allocator.free(slots)
            self.counters.prefetch_dropped_tokens += n
            return
        self.host_pool.allocator.free(slots[: present - op.start])
        op.inserted = len(key) - present
        self.counters.prefetched_tokens += op.inserted

    def wait_prefetches(self, timeout: float = 10.0) -> None:
        """Block until every running prefetch finished, then insert them (for tests and shutdown)."""
        deadline = time.monotonic() + timeout
        for op in list(self._ops.values()):
            op.future.exception(timeout=max(deadline - time.monotonic(), 0))
        self.poll()

    # ================================================================== maintenance
    def flush(self) -> None:
        """The tree was reset: every host slot is free again; running prefetches are forgotten."""
        self.host_pool.allocator.reset()
        self._ops.clear()
        self.copier.reset()

    def integrity_problems(self) -> list[str]:
        """Faults of the host tier: host free + host-resident == host total, no slot free and in the
        tree at once or in the tree twice, and the tree's tier structure (see ``tier_problems``)."""
        problems = list(self.tree.tier_problems())
        alloc = self.host_pool.allocator
        free = alloc.free_slots()
        held = self.tree.all_host_slots()
        if free.numel() + self.tree.host_size != alloc.total_size:
            problems.append(
                f"host: free {free.numel()} + in tree {self.tree.host_size} != total {alloc.total_size}"
            )
        both = torch.cat([free, held])
        if torch.unique(both).numel() != both.numel():
            problems.append("host: a slot is held twice (free and in the tree, or duplicated)")
        if both.numel() and not bool(((both >= 1) & (both <= alloc.total_size)).all()):
            problems.append("host: slot out of range")
        return problems

    def reset_counters(self) -> None:
        self.counters = _Counters()

    def stats(self) -> dict[str, float]:
        """Counters for ``live_stats``: hits per tier (tokens), bytes moved, pool usage."""
        c = self.counters
        alloc = self.host_pool.allocator
        out: dict[str, float] = {
            "hicache_host_total_tokens": alloc.total_size,
            "hicache_host_used_tokens": alloc.total_size - alloc.available_size,
            "hicache_device_hit_tokens": c.device_hit_tokens,
            "hicache_host_hit_tokens": c.host_hit_tokens,
            "hicache_storage_hit_tokens": c.storage_hit_tokens,
            "hicache_backed_up_tokens": c.backed_up_tokens,
            "hicache_loaded_tokens": c.loaded_tokens,
            "hicache_evicted_to_host_tokens": c.evicted_to_host_tokens,
            "hicache_prefetched_tokens": c.prefetched_tokens,
            "hicache_prefetch_ops": c.prefetch_ops,
            "hicache_prefetch_timeouts": c.prefetch_timeouts,
            "hicache_prefetch_dropped_tokens": c.prefetch_dropped_tokens,
            "hicache_bytes_device_to_host": c.bytes_device_to_host,
            "hicache_bytes_host_to_device": c.bytes_host_to_device,
        }
        if self.storage is not None:
            s = self.storage.stats()
            out.update({
                "hicache_bytes_storage_read": s.get("bytes_read", 0),
                "hicache_bytes_storage_written": s.get("bytes_written", 0),
                "hicache_storage_pages_written": s.get("pages_written", 0),
                "hicache_storage_pages_read": s.get("pages_read", 0),
                "hicache_storage_corrupt_pages": s.get("corrupt_pages", 0),
            })  # fmt: skip
        return out

    def close(self) -> None:
        """Stop prefetch threads and finish queued storage writes."""
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
        if self.storage is not None:
            self.storage.close()


def host_pool_tokens(device_pool: KVPool, *, ratio: float, size_gb: float | None) -> int:
    """Host pool size in tokens: ``size_gb`` of memory when given, else ``ratio`` x the device pool."""
    if size_gb is not None and size_gb > 0:
        return int(size_gb * 2**30 // device_pool.bytes_per_token)
    return int(ratio * device_pool.size)


HOST_MEMORY_SHARE = 0.8  # of the memory available at start: the rest is the process's own and the OS's


def available_host_bytes() -> int | None:
    """Host memory available now (Linux ``MemAvailable``), or None where the OS does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_memory(pool_bytes: int, available: int | None) -> None:
    """Refuse a host pool the machine cannot hold: allocating it would get the process killed by
    the kernel's out-of-memory killer, with no message, rather than fail."""
    if available is not None and pool_bytes > HOST_MEMORY_SHARE * available:
        raise ValueError(
            f"the host KV pool would take {pool_bytes / 2**30:.1f} GiB of host memory, but only "
            f"{available / 2**30:.1f} GiB are available; lower --hicache-ratio or set --hicache-size"
        )


def build_hicache(
    device_pool: KVPool,
    tree: RadixTree,
    *,
    ratio: float = 2.0,
    size_gb: float | None = None,
    write_policy: str = "write_through",
    storage_backend: str | None = None,
    storage_dir: str | None = None,
    prefetch_policy: str = "timeout",
    model_id: str = "",
    storage_page_size: int = 64,
    check: bool = False,
) -> HiCacheController:
    """The controller for an engine: a host pool sized from the device pool, and the storage tier
    when a backend is named (``"file"`` needs ``storage_dir``)."""
    tokens = host_pool_tokens(device_pool, ratio=ratio, size_gb=size_gb)
    if tokens < 1:
        raise ValueError(
            f"the host KV pool would hold {tokens} tokens; raise --hicache-ratio or --hicache-size"
        )
    check_host_memory(tokens * device_pool.bytes_per_token, available_host_bytes())
    host = HostKVPool.like(device_pool, tokens, check=check)
    storage = None
    if storage_backend not in (None, "", "none"):
        if storage_backend not in STORAGE_BACKENDS:
            raise ValueError(
                f"unknown storage backend {storage_backend!r}; one of {sorted(STORAGE_BACKENDS)}"
            )
        if not storage_dir:
            raise ValueError("--hicache-storage-backend file needs --hicache-storage-dir")
        storage = STORAGE_BACKENDS[storage_backend](
            storage_dir,
            model_id=model_id,
            num_layers=device_pool.num_layers,
            num_kv_heads=device_pool.num_kv_heads,
            head_dim=device_pool.head_dim,
            dtype=device_pool.dtype,
            page_size=storage_page_size,
        )
    logger.info(
        "hierarchical cache: host pool %d tokens (%.2f GB), write policy %s, storage %s",
        tokens, tokens * device_pool.bytes_per_token / 2**30, write_policy, storage_backend or "none",
    )  # fmt: skip
    config = HiCacheConfig(write_policy=write_policy, prefetch_policy=prefetch_policy)
    return HiCacheController(
        tree=tree, device_pool=device_pool, host_pool=host, config=config, storage=storage, model_id=model_id
    )
