"""CacheManager: request lifecycles over the radix tree and the allocator, and the pool invariant."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from phloem.runtime.cache.allocator import TokenSlotAllocator
from phloem.runtime.cache.cache_manager import CacheHandle, CacheIntegrityError, CacheManager
from phloem.runtime.cache.radix_tree import RadixTree

ROWS, MAX_CONTEXT = 8, 64


def make(num_slots: int = 65, *, radix: bool = True) -> tuple[CacheManager, torch.Tensor]:
    table = torch.zeros(ROWS, MAX_CONTEXT, dtype=torch.int64)
    cm = CacheManager(
        allocator=TokenSlotAllocator(num_slots, check=True),
        req_to_token=table,
        tree=RadixTree() if radix else None,
    )
    return cm, table


@dataclass
class Req:
    """The slice of a scheduler request these tests need."""

    row: int
    tokens: list[int]
    prompt_len: int
    handle: CacheHandle
    allocated: int
    extra_key: str | None = None
    kv_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.kv_len = self.handle.prefix_len


def admit(
    cm: CacheManager, table: torch.Tensor, row: int, prompt: list[int], extra_key: str | None = None
) -> Req:
    """Match (capped at prompt_len - 1), lock, and copy the cached prefix into the request's row."""
    m = cm.match(prompt, extra_key=extra_key, max_len=len(prompt) - 1)
    handle = cm.acquire(m, extra_key=extra_key)
    table[row, : m.length] = m.slots
    return Req(
        row=row,
        tokens=list(prompt),
        prompt_len=len(prompt),
        handle=handle,
        allocated=m.length,
        extra_key=extra_key,
    )


def extend(cm: CacheManager, table: torch.Tensor, req: Req, n: int) -> bool:
    """Allocate and 'compute' the next n tokens of the request; False when the pool is full."""
    slots = cm.alloc(n)
    if slots is None:
        return False
    table[req.row, req.allocated : req.allocated + n] = slots
    req.allocated += n
    req.kv_len += n
    return True


def prefill(cm: CacheManager, table: torch.Tensor, req: Req, *, chunk: int | None = None) -> None:
    """Prefill the rest of the prompt, in chunks, caching each finished chunk; then sample a token."""
    while req.kv_len < req.prompt_len:
        n = min(chunk or req.prompt_len, req.prompt_len - req.kv_len)
        assert extend(cm, table, req, n)
        if req.kv_len < req.prompt_len:
            cm.cache_unfinished(req.handle, req.tokens, table[req.row, : req.kv_len], req_row=req.row)
    req.tokens.append(1000 + len(req.tokens))


def decode(cm: CacheManager, table: torch.Tensor, req: Req, steps: int) -> None:
    for _ in range(steps):
        assert extend(cm, table, req, 1)
        req.tokens.append(1000 + len(req.tokens))


def finish(cm: CacheManager, table: torch.Tensor, req: Req) -> None:
    cm.cache_finished(req.handle, req.tokens, table[req.row, : req.allocated], kv_len=req.kv_len)


def private(table: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    parts = [table[r.row, r.handle.prefix_len : r.allocated] for r in reqs]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


# ---------------------------------------------------------------------- lifecycles
def test_single_request_lifecycle_caches_prompt_and_output() -> None:
    cm, table = make()
    req = admit(cm, table, 0, list(range(1, 11)))
    assert req.handle.prefix_len == 0
    prefill(cm, table, req)
    decode(cm, table, req, 3)
    assert req.kv_len == 13 and len(req.tokens) == 14  # the last sampled token has no KV
    cm.check_integrity(private=private(table, [req]))
    row = table[0, :13].clone()
    finish(cm, table, req)
    assert (cm.evictable_size, cm.locked_size, cm.free_size) == (13, 0, 64 - 13)
    m = cm.match(req.tokens)
    assert m.length == 13 and torch.equal(m.slots, row)
    cm.check_integrity()


def test_match_is_capped_so_one_token_is_computed() -> None:
    cm, table = make()
    first = admit(cm, table, 0, [5, 6, 7, 8])
    prefill(cm, table, first)
    finish(cm, table, first)
    again = admit(cm, table, 1, [5, 6, 7, 8])
    assert again.handle.prefix_len == 3
    assert cm.match([5, 6, 7, 8], max_len=0).length == 0


def test_shared_prefix_is_reused_and_locked() -> None:
    cm, table = make()
    a = admit(cm, table, 0, [1, 2, 3, 4, 5, 6])
    prefill(cm, table, a)
    finish(cm, table, a)
    b = admit(cm, table, 1, [1, 2, 3, 4, 9, 9])
    assert b.handle.prefix_len == 4
    assert torch.equal(table[1, :4], table[0, :4])
    assert cm.locked_size == 4
    prefill(cm, table, b)
    cm.check_integrity(private=private(table, [b]))
    finish(cm, table, b)
    assert (cm.locked_size, cm.evictable_size) == (0, 6 + 2)  # a's prompt, then b's two new tokens
    cm.check_integrity()


def test_concurrent_duplicates_are_freed_on_finish() -> None:
    cm, table = make()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    a = admit(cm, table, 0, prompt)
    b = admit(cm, table, 1, prompt)  # nothing cached yet: both compute the prompt privately
    prefill(cm, table, a)
    prefill(cm, table, b)
    b.tokens[-1] = 7  # b samples a different first output token
    decode(cm, table, a, 2)
    decode(cm, table, b, 2)
    a_row = table[0, : a.allocated].clone()
    finish(cm, table, a)
    free_before = cm.free_size
    finish(cm, table, b)
    # b's prompt slots duplicated a's and went back to the free list; its (different) outputs stayed
    assert cm.free_size == free_before + len(prompt)
    assert torch.equal(cm.match(a.tokens).slots, a_row)
    cm.check_integrity()


def test_chunked_prefill_points_row_at_tree_slots() -> None:
    cm, table = make()
    prompt = list(range(20, 33))
    a = admit(cm, table, 0, prompt)
    b = admit(cm, table, 1, prompt)
    for req in (a, b):
        assert extend(cm, table, req, 5)
        node, plen = cm.cache_unfinished(req.handle, req.tokens, table[req.row, :5], req_row=req.row)
        assert plen == 5 and req.handle.prefix_len == 5 and node is req.handle.node
    # b's first chunk duplicated a's: freed, and b's row now reads a's slots
    assert torch.equal(table[1, :5], table[0, :5])
    assert cm.locked_size == 5
    cm.check_integrity(private=private(table, [a, b]))
    prefill(cm, table, a, chunk=4)
    prefill(cm, table, b, chunk=4)
    assert torch.equal(table[1, :9], table[0, :9])  # every chunk but the last one is shared
    assert not bool((table[1, 9:13] == table[0, 9:13]).any())  # the last chunk waits for finish
    cm.check_integrity(private=private(table, [a, b]))
    finish(cm, table, a)
    finish(cm, table, b)
    assert cm.locked_size == 0
    cm.check_integrity()


def test_cache_finished_frees_slots_past_kv_len() -> None:
    cm, table = make()
    req = admit(cm, table, 0, [7, 7, 7])
    prefill(cm, table, req)
    assert extend(cm, table, req, 2)  # e.g. speculative slots, KV never committed
    req.kv_len -= 2
    finish(cm, table, req)
    assert cm.evictable_size == 3 and cm.free_size == 64 - 3
    cm.check_integrity()


def test_release_on_abort_keeps_tree_part() -> None:
    cm, table = make()
    a = admit(cm, table, 0, [1, 2, 3, 4])
    prefill(cm, table, a)
    finish(cm, table, a)
    b = admit(cm, table, 1, [1, 2, 3, 4, 5, 6])
    prefill(cm, table, b)
    cm.release(b.handle, table[1, : b.allocated])
    assert b.handle.node is None and b.handle.prefix_len == 0
    assert (cm.locked_size, cm.evictable_size) == (0, 4)
    cm.check_integrity()


def test_extra_key_requests_do_not_share() -> None:
    cm, table = make()
    a = admit(cm, table, 0, [1, 2, 3, 4], extra_key="a")
    prefill(cm, table, a)
    finish(cm, table, a)
    assert cm.match([1, 2, 3, 4], extra_key="b").length == 0
    assert cm.match([1, 2, 3, 4], extra_key="a").length == 4


# ---------------------------------------------------------------------- pressure, modes, flush
def test_alloc_evicts_lru_unlocked_leaves_under_pressure() -> None:
    cm, table = make(num_slots=17)  # 16 usable
    old = admit(cm, table, 0, [1] * 6)
    prefill(cm, table, old)
    finish(cm, table, old)  # 6 cached
    kept = admit(cm, table, 1, [2] * 6)
    prefill(cm, table, kept)
    finish(cm, table, kept)  # 6 cached, newer
    holder = admit(cm, table, 2, [2] * 6 + [3])  # locks the newer entry's 6 tokens
    assert cm.free_size == 4 and cm.available_size == 4 + 6
    got = cm.alloc(8)
    assert got is not None
    assert cm.match([1] * 6).length == 0  # the old entry went
    assert cm.locked_size == 6
    assert cm.alloc(3) is None  # 2 free, nothing evictable
    assert cm.match([2] * 6).length == 6
    cm.free_slots(got)
    cm.release(holder.handle, table[2, : holder.allocated])
    cm.check_integrity()


def test_eviction_frees_a_chunk_so_small_allocations_do_not_walk_the_tree_each_time() -> None:
    cm, table = make(num_slots=641)  # 640 usable: an eviction frees at least 640 // 64 = 10 slots
    for i in range(64):  # fill the pool with 64 cached prompts of 10 tokens
        req = admit(cm, table, 0, [i + 1] * 9 + [5000 + i])
        prefill(cm, table, req)
        finish(cm, table, req)
    assert cm.free_size == 0 and cm.evictable_size == 640
    calls = []
    evict = cm._tree.evict
    cm._tree.evict = lambda n, **kw: calls.append(n) or evict(n, **kw)  # type: ignore[method-assign]
    got = [cm.alloc(1) for _ in range(30)]  # one decode token at a time
    assert all(g is not None for g in got) and calls == [10, 10, 10]  # not 30 walks of the tree
    assert cm.free_size == 0 and cm.evictable_size == 640 - 30
    assert cm.match([1] * 9).length == 0 and cm.match([64] * 9).length == 9  # least recent went first
    for g in got:
        cm.free_slots(g)
    cm.check_integrity()


def test_alloc_none_evicts_nothing() -> None:
    cm, table = make(num_slots=9)  # 8 usable
    a = admit(cm, table, 0, [1, 2, 3, 4])
    prefill(cm, table, a)
    finish(cm, table, a)
    assert cm.alloc(9) is None
    assert cm.evictable_size == 4


def test_disabled_radix_cache_shares_nothing_and_frees_everything() -> None:
    cm, table = make(radix=False)
    assert not cm.radix_enabled
    a = admit(cm, table, 0, list(range(10)))
    prefill(cm, table, a, chunk=3)
    decode(cm, table, a, 4)
    b = admit(cm, table, 1, list(range(10)))
    assert b.handle.prefix_len == 0 and b.handle.node is None
    cm.check_integrity(private=private(table, [a, b]))
    finish(cm, table, a)
    assert (cm.free_size, cm.evictable_size, cm.locked_size) == (64, 0, 0)
    cm.check_integrity()
    assert cm.flush()


def test_flush_only_when_nothing_is_held() -> None:
    cm, table = make()
    a = admit(cm, table, 0, [1, 2, 3])
    prefill(cm, table, a)
    finish(cm, table, a)
    b = admit(cm, table, 1, [1, 2, 3, 4])
    assert not cm.flush()  # b locks [1, 2, 3]
    cm.release(b.handle, table[1, : b.allocated])
    stray = cm.alloc(2)
    assert stray is not None and not cm.flush()  # private slots are out
    cm.free_slots(stray)
    assert cm.flush()
    assert (cm.free_size, cm.evictable_size) == (64, 0)
    assert cm.match([1, 2, 3]).length == 0


def test_integrity_check_detects_leaks_and_double_ownership() -> None:
    cm, table = make()
    a = admit(cm, table, 0, [1, 2, 3])
    prefill(cm, table, a)
    with pytest.raises(CacheIntegrityError):
        cm.check_integrity()  # a's 3 private slots are not accounted for
    cm.check_integrity(private=3)
    finish(cm, table, a)
    leaked = cm.alloc(1)
    assert leaked is not None
    with pytest.raises(CacheIntegrityError):
        cm.check_integrity()
    cm.check_integrity(private=leaked)
    in_tree = cm.match([1, 2, 3]).slots[:1]
    with pytest.raises(CacheIntegrityError):
        cm.check_integrity(private=in_tree)  # right count, but the slot is the tree's


# ---------------------------------------------------------------------- random request streams
class Simulation:
    """Random admissions, chunked prefill, decode, finish, abort and retraction over a small pool.

    A fake KV pool records, for each slot written by a 'forward', the (extra_key, prefix) whose last
    token it holds; every running request's row must read back exactly its own tokens.
    """

    def __init__(self, rng: random.Random, *, radix: bool) -> None:
        self.rng = rng
        self.cm, self.table = make(num_slots=49, radix=radix)
        self.kv: dict[int, tuple[str | None, tuple[int, ...]]] = {}
        self.running: list[Req] = []
        self.stems = [[rng.randrange(4) for _ in range(rng.randint(2, 10))] for _ in range(3)]

    def step(self) -> None:
        ops = (
            [self.admit] * 2 + [self.advance] * 5 + [self.finish] + [self.abort] * (1 if self.running else 0)
        )
        self.rng.choice(ops)()
        self.check()

    def admit(self) -> None:
        free_rows = set(range(ROWS)) - {r.row for r in self.running}
        if not free_rows:
            return
        prompt = self.rng.choice(self.stems) + [self.rng.randrange(4) for _ in range(self.rng.randint(1, 8))]
        extra_key = self.rng.choice([None, None, "x"])
        self.running.append(admit(self.cm, self.table, min(free_rows), prompt, extra_key))

    def advance(self) -> None:
        if not self.running:
            return
        req = self.rng.choice(self.running)
        prefilling = req.kv_len < req.prompt_len
        n = min(self.rng.randint(1, 6), req.prompt_len - req.kv_len) if prefilling else 1
        if req.allocated + n >= MAX_CONTEXT:
            return self.finish(req)
        if not extend(self.cm, self.table, req, n):
            return self.abort(req)  # retraction: the pool cannot hold this step
        self.write_kv(req, req.kv_len - n, req.kv_len)
        if req.kv_len < req.prompt_len:
            if self.rng.random() < 0.7:
                self.cm.cache_unfinished(
                    req.handle, req.tokens, self.table[req.row, : req.kv_len], req_row=req.row
                )
        else:
            req.tokens.append(self.rng.randrange(4))

    def finish(self, req: Req | None = None) -> None:
        ready = [r for r in self.running if r.kv_len >= r.prompt_len]
        req = req or (self.rng.choice(ready) if ready else None)
        if req is None:
            return
        self.running.remove(req)
        finish(self.cm, self.table, req)

    def abort(self, req: Req | None = None) -> None:
        req = req or self.rng.choice(self.running)
        self.running.remove(req)
        self.cm.release(req.handle, self.table[req.row, : req.allocated])

    def write_kv(self, req: Req, start: int, stop: int) -> None:
        for pos in range(start, stop):
            self.kv[int(self.table[req.row, pos])] = (req.extra_key, tuple(req.tokens[: pos + 1]))

    def check(self) -> None:
        self.cm.check_integrity(private=private(self.table, self.running))
        for req in self.running:
            for pos in range(req.kv_len):
                slot = int(self.table[req.row, pos])
                assert self.kv[slot] == (req.extra_key, tuple(req.tokens[: pos + 1])), (req, pos)

    def drain(self) -> None:
        while self.running:
            if self.rng.random() < 0.3:
                self.abort(self.running[0])
            else:
                self.finish(self.running[0])
        self.cm.check_integrity()
        assert self.cm.locked_size == 0
        assert self.cm.free_size + self.cm.evictable_size == self.cm.total_size
        assert self.cm.flush()


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
@given(seed=st.integers(0, 2**32 - 1))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_request_streams_keep_the_invariant(radix: bool, seed: int) -> None:
    sim = Simulation(random.Random(seed), radix=radix)
    for _ in range(120):
        sim.step()
    sim.drain()
