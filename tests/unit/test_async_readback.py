"""Slot numbers read back from the device-side ``req_to_token`` (a finished request's row) reach the
allocator and the radix tree without waiting for the stream (``host_copy.to_host_async``): the
copy's event is awaited only where the values are read. On the CPU there is no event, so these
tests stand a recording event in for CUDA's."""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.cache import allocator as allocator_mod
from phloem.runtime.cache import radix_tree as radix_mod
from phloem.runtime.cache.allocator import TokenSlotAllocator
from phloem.runtime.cache.radix_tree import RadixTree
from phloem.runtime.host_copy import to_host_async


class RecordingEvent:
    """Logs each wait; ``query()`` says whether the copy has landed (``LANDED[0]``, set by tests)."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(self.name)

    def query(self) -> bool:
        return LANDED[0]


LANDED = [False]


@pytest.fixture
def waits(monkeypatch) -> list[str]:
    """Every ``to_host_async`` copy comes with an event that logs its wait (not landed yet)."""
    log: list[str] = []
    LANDED[0] = False

    def fake(t: torch.Tensor):
        host, _ = to_host_async(t)
        return host, RecordingEvent(log, f"copy{len(log)}:{host.tolist()}")

    monkeypatch.setattr(allocator_mod, "to_host_async", fake)
    monkeypatch.setattr(radix_mod, "to_host_async", fake)
    return log


def test_host_tensors_need_no_event():
    host, ready = to_host_async(torch.tensor([[3, 4], [5, 6]], dtype=torch.int32))
    assert ready is None and host.dtype == torch.int64 and host.tolist() == [3, 4, 5, 6]


def test_freed_slots_are_awaited_only_when_merged(waits):
    alloc = TokenSlotAllocator(9)  # slots 1..8
    taken = alloc.alloc(6)
    alloc.free(taken[:3])
    assert alloc.available_size == 5 and waits == []  # counted at once, not read
    assert alloc.alloc(2) is not None and waits == []  # the front still had two
    got = alloc.alloc(3)  # needs the freed chunk: its copy is awaited, then its slots are used
    assert waits == [f"copy0:{taken[:3].tolist()}"]
    assert sorted(got.tolist()) == sorted(taken[:3].tolist())


def test_tree_leaf_is_awaited_on_first_read_only(waits):
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], torch.tensor([11, 12, 13, 14]))
    assert waits == []  # stored without waiting
    assert tree.evictable_size == 4 and waits == []  # sizes need no values
    m = tree.match_prefix([1, 2, 3, 9])
    assert m.slots.tolist() == [11, 12, 13] and len(waits) == 1  # the first read waits
    tree.match_prefix([1, 2])
    assert len(waits) == 1  # once


def test_eviction_reads_pending_values(waits):
    tree = RadixTree()
    tree.insert([5, 6], torch.tensor([21, 22]))
    freed = tree.evict(2)
    assert sorted(freed.tolist()) == [21, 22] and len(waits) == 1


def test_sharing_a_computed_prefix_waits_for_nothing_new(waits):
    """``cache_unfinished`` (a prefill pass shares its prompt) must not read the slots it just
    stored; with another request's copy of the same tokens in the tree, it reads only the older
    nodes to point the row at the tree's slots."""
    from phloem.runtime.cache.cache_manager import CacheManager

    table = torch.zeros(4, 32, dtype=torch.int64)
    cm = CacheManager(allocator=TokenSlotAllocator(65), req_to_token=table, tree=RadixTree())
    prompt = [7, 8, 9, 10, 11, 12]

    def prefill(row: int):
        handle = cm.acquire(cm.match(prompt, max_len=len(prompt) - 1))
        slots = cm.alloc(len(prompt))
        table[row, : len(prompt)] = slots
        return handle, slots

    first, first_slots = prefill(0)
    second, second_slots = prefill(1)  # computed the same tokens before the first was shared
    cm.cache_unfinished(first, prompt, table[0, : len(prompt)], req_row=0)
    assert waits == [] and first.prefix_len == len(prompt)
    assert table[0, : len(prompt)].tolist() == first_slots.tolist()
    cm.cache_unfinished(second, prompt, table[1, : len(prompt)], req_row=1)
    # the second row now points at the first request's slots (read once: that node's copy)
    assert table[1, : len(prompt)].tolist() == first_slots.tolist()
    assert len(waits) == 1 and second.node is first.node
    assert cm.available_size == 64 - len(prompt)  # the second request's duplicates were freed


def _finish_one(setup, tokens: list[int]) -> list[int]:
    """A request computes ``tokens`` from scratch and finishes (its row read back asynchronously);
    returns its slots."""
    handle = setup.cm.acquire(setup.cm.match(tokens, max_len=len(tokens) - 1))
    slots = setup.cm.alloc(len(tokens))
    setup.write(tokens, slots, 0)
    setup.table[0, : len(tokens)] = slots
    setup.cm.cache_finished(handle, tokens, setup.table[0, : len(tokens)])
    return slots.tolist()


def test_write_through_backs_up_once_the_slots_have_landed(waits):
    """With the host tier on, a finished request's node is copied to the host only once its slot
    numbers are on the host: never by waiting for the forward pass in flight."""
    from tests.unit.test_hicache import Setup, seq

    s = Setup(policy="write_through")
    tokens = seq(100, 20)
    _finish_one(s, tokens)
    assert waits == [] and s.hc.counters.backed_up_tokens == 0  # queued, nothing read
    s.cm.match(seq(900, 4))  # the next admission polls: the copy has not landed yet
    assert waits == [] and s.hc.counters.backed_up_tokens == 0
    LANDED[0] = True
    s.cm.match(seq(900, 4))
    assert waits == [] and s.hc.counters.backed_up_tokens == 20  # landed: no wait needed
    assert s.tree.find_node(tokens).tier == "both"
    s.cm.check_integrity()
    s.run(tokens)  # served from the cache, with the KV the request wrote
    assert s.hc.counters.backed_up_tokens == 20


def test_eviction_backs_up_a_node_still_waiting_for_its_slots(waits):
    """Under write-through a node due for its host copy keeps it even when eviction comes first."""
    from tests.unit.test_hicache import Setup, seq

    s = Setup(device=64, policy="write_through")
    first = seq(100, 40)
    first_slots = _finish_one(s, first)
    assert waits == [] and s.hc.counters.backed_up_tokens == 0
    s.run(seq(500, 40))  # needs room before the copy lands: the first prompt leaves the device
    assert waits[0] == f"copy0:{first_slots}"  # eviction read the slots (waited) to copy them out
    assert s.hc.counters.backed_up_tokens >= 40
    m = s.cm.match(first, max_len=39)
    assert (m.length, m.host_length) == (0, 39)
    s.run(first)  # loaded back from the host with the KV it was computed with
