"""RadixTree: unit cases plus a stateful property test against a per-token reference model."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule
from phloem.runtime.cache.radix_tree import Node, RadixTree


def _t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def _node_count(tree: RadixTree) -> int:
    return sum(1 for _ in tree._nodes())


# ---------------------------------------------------------------------- unit cases
def test_empty_tree_and_empty_key() -> None:
    tree = RadixTree()
    r = tree.match_prefix([1, 2])
    assert (r.length, r.slots.tolist(), r.last_node) == (0, [], tree.root)
    assert tree.insert([], _t()) == 0
    assert tree.match_prefix([]).length == 0
    assert (tree.total_size, tree.evictable_size, tree.locked_size) == (0, 0, 0)


def test_insert_returns_length_already_present() -> None:
    tree = RadixTree()
    assert tree.insert([1, 2, 3, 4], _t(11, 12, 13, 14)) == 0
    assert tree.insert([1, 2, 3, 4], _t(91, 92, 93, 94)) == 4
    assert tree.insert([1, 2, 7], _t(91, 92, 97)) == 2
    assert tree.insert([1, 2, 3, 4, 5, 6], _t(0, 0, 0, 0, 15, 16)) == 4
    assert tree.total_size == 7
    # the tree keeps its own slots for the present range and takes the caller's for the new suffix
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == [11, 12, 13, 14, 15, 16]
    assert tree.match_prefix([1, 2, 7]).slots.tolist() == [11, 12, 97]


def test_insert_copies_slots() -> None:
    tree = RadixTree()
    row = _t(5, 6, 7)
    tree.insert([1, 2, 3], row)
    row.fill_(0)
    assert tree.match_prefix([1, 2, 3]).slots.tolist() == [5, 6, 7]


def test_match_ending_inside_a_node_splits_it() -> None:
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], _t(11, 12, 13, 14))
    assert _node_count(tree) == 1
    r = tree.match_prefix([1, 2, 9])
    assert (r.length, r.slots.tolist(), r.last_node.key) == (2, [11, 12], (1, 2))
    assert _node_count(tree) == 2
    assert list(r.last_node.children.values())[0].key == (3, 4)
    assert tree.total_size == 4
    # a query shorter than the node also splits
    r = tree.match_prefix([1])
    assert (r.length, r.last_node.key, _node_count(tree)) == (1, (1,), 3)
    assert tree.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == [11, 12, 13, 14]


def test_split_keeps_the_lower_node_standing_for_its_full_prefix() -> None:
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], _t(11, 12, 13, 14))
    deep = tree.match_prefix([1, 2, 3, 4]).last_node
    tree.lock(deep)
    tree.match_prefix([1, 2])  # splits the locked node
    assert deep.key == (3, 4) and deep.depth == 4
    assert deep.parent is not None and deep.parent.lock_ref == 1
    assert (tree.locked_size, tree.evictable_size) == (4, 0)
    tree.unlock(deep)
    assert (tree.locked_size, tree.evictable_size) == (0, 4)


def test_extra_key_namespaces_never_share() -> None:
    tree = RadixTree()
    assert tree.insert([1, 2, 3], _t(1, 2, 3)) == 0
    assert tree.insert([1, 2, 3], _t(4, 5, 6), extra_key="lora-a") == 0
    assert tree.insert([1, 2], _t(7, 8), extra_key="lora-b") == 0
    assert len(tree.root.children) == 3
    assert tree.match_prefix([1, 2, 3], extra_key="lora-a").slots.tolist() == [4, 5, 6]
    assert tree.match_prefix([1, 2, 3], extra_key="lora-b").slots.tolist() == [7, 8]
    assert tree.match_prefix([1, 2, 3]).slots.tolist() == [1, 2, 3]
    assert tree.match_prefix([1, 2, 3], extra_key="other").length == 0
    tree.lock(tree.match_prefix([1, 2, 3], extra_key="lora-a").last_node)
    assert sorted(tree.evict(100).tolist()) == [1, 2, 3, 7, 8]
    assert tree.match_prefix([1, 2, 3], extra_key="lora-a").length == 3


def test_evict_lru_order() -> None:
    tree = RadixTree()
    tree.insert([1, 1], _t(1, 2))
    tree.insert([2, 2], _t(3, 4))
    tree.insert([3, 3], _t(5, 6))
    tree.match_prefix([1, 1])  # [1, 1] is now the most recently used
    assert tree.evict(1).tolist() == [3, 4]
    assert tree.evict(2).tolist() == [5, 6]
    assert tree.evict(2).tolist() == [1, 2]
    assert tree.total_size == 0


def test_evict_parent_becoming_leaf_is_next_candidate() -> None:
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], _t(11, 12, 13, 14))
    tree.insert([1, 2, 5], _t(11, 12, 15))  # splits into [1,2] -> {[3,4], [5]}
    tree.insert([9], _t(19))  # newest
    assert sorted(tree.evict(3).tolist()) == [13, 14, 15]
    # [1, 2] is now an unlocked leaf older than [9]: it goes first
    assert tree.evict(1).tolist() == [11, 12]
    assert tree.match_prefix([9]).length == 1


def test_lock_protects_path_and_evict_returns_all_evictable() -> None:
    tree = RadixTree()
    tree.insert([1, 2, 3], _t(1, 2, 3))
    tree.insert([1, 2, 4, 5], _t(1, 2, 4, 5))
    node = tree.match_prefix([1, 2, 3]).last_node
    tree.lock(node)
    tree.lock(node)
    assert (tree.locked_size, tree.evictable_size, tree.total_size) == (3, 2, 5)
    assert sorted(tree.evict(100).tolist()) == [4, 5]
    assert tree.evict(100).numel() == 0
    tree.unlock(node)
    assert tree.evict(1).numel() == 0  # still locked once
    tree.unlock(node)
    assert (tree.locked_size, tree.evictable_size) == (0, 3)
    with pytest.raises(RuntimeError):
        tree.unlock(node)
    assert sorted(tree.evict(3).tolist()) == [1, 2, 3]


def test_lock_of_evicted_node_raises() -> None:
    tree = RadixTree()
    tree.insert([1, 2], _t(1, 2))
    node = tree.match_prefix([1, 2]).last_node
    tree.evict(2)
    with pytest.raises(RuntimeError):
        tree.lock(node)


def test_tensor_keys_reset_and_pretty_print(capsys: pytest.CaptureFixture[str]) -> None:
    tree = RadixTree()
    tree.insert(torch.tensor([4, 5, 6]), _t(1, 2, 3), extra_key="k")
    assert tree.match_prefix(torch.tensor([4, 5]), extra_key="k").length == 2
    text = tree.pretty_print()
    assert "extra_key='k'" in text and "[4, 5]" in text and "[6]" in text
    assert sorted(tree.all_slots().tolist()) == [1, 2, 3]
    tree.reset()
    assert (tree.total_size, tree.all_slots().numel()) == (0, 0)


# ---------------------------------------------------------------------- stateful property test
TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=9)
EXTRA_KEYS = st.sampled_from([None, "a"])


class RadixTreeMachine(RuleBasedStateMachine):
    """Reference model: every cached prefix ``(extra_key, tokens[:i+1])`` maps to the slot of token i.

    The cached set is prefix-closed; insert adds missing prefixes with the caller's slots, match
    walks it, evict may remove only prefixes no locked path covers, and only whole sub-paths.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree()
        self.ref: dict[tuple[str | None, tuple[int, ...]], int] = {}
        self.locks: list[tuple[Node, str | None, tuple[int, ...]]] = []
        self.fresh = itertools.count(1)
        self.freed: set[int] = set()

    def _ref_match(self, key: list[int], extra_key: str | None) -> list[int]:
        out = []
        for i in range(len(key)):
            slot = self.ref.get((extra_key, tuple(key[: i + 1])))
            if slot is None:
                break
            out.append(slot)
        return out

    def _locked_prefixes(self) -> set[tuple[str | None, tuple[int, ...]]]:
        return {(ek, path[: i + 1]) for _, ek, path in self.locks for i in range(len(path))}

    inserted = Bundle("inserted")

    @rule(target=inserted, key=TOKENS, extra_key=EXTRA_KEYS)
    def insert(self, key: list[int], extra_key: str | None) -> tuple[list[int], str | None]:
        slots = [next(self.fresh) for _ in key]
        expected = len(self._ref_match(key, extra_key))
        assert self.tree.insert(key, torch.tensor(slots, dtype=torch.int64), extra_key=extra_key) == expected
        for i in range(expected, len(key)):
            self.ref[(extra_key, tuple(key[: i + 1]))] = slots[i]
        return key, extra_key

    @rule(entry=inserted, cut=st.integers(0, 9), lock=st.booleans())
    def match_inserted_prefix(self, entry: tuple[list[int], str | None], cut: int, lock: bool) -> None:
        """Matches ending inside earlier insertions: splits, and locks on interior nodes."""
        key, extra_key = entry
        self.match(key[:cut], extra_key, lock)

    @rule(key=TOKENS, extra_key=EXTRA_KEYS, lock=st.booleans())
    def match_random(self, key: list[int], extra_key: str | None, lock: bool) -> None:
        self.match(key, extra_key, lock)

    def match(self, key: list[int], extra_key: str | None, lock: bool) -> None:
        r = self.tree.match_prefix(key, extra_key=extra_key)
        expected = self._ref_match(key, extra_key)
        assert r.length == len(expected) == r.slots.numel()
        assert r.slots.tolist() == expected
        assert r.last_node.depth == r.length
        if lock and r.length > 0:
            self.tree.lock(r.last_node)
            self.locks.append((r.last_node, extra_key, tuple(key[: r.length])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, _, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.tree.unlock(node)

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        evictable_before = self.tree.evictable_size
        freed = self.tree.evict(n).tolist()
        assert len(set(freed)) == len(freed)
        assert not (set(freed) & self.freed), "slot freed twice"
        protected = self._locked_prefixes()
        by_slot = {slot: prefix for prefix, slot in self.ref.items()}
        for slot in freed:
            prefix = by_slot[slot]
            assert prefix not in protected, "evicted a locked token"
            del self.ref[prefix]
        self.freed |= set(freed)
        if n > 0:
            assert len(freed) >= min(n, evictable_before)
            if len(freed) < n:
                assert self.tree.evictable_size == 0
        # what remains is still prefix-closed
        for ek, path in self.ref:
            assert len(path) == 1 or (ek, path[:-1]) in self.ref

    @invariant()
    def sizes_match_model(self) -> None:
        locked = len(self._locked_prefixes())
        assert self.tree.total_size == len(self.ref)
        assert self.tree.locked_size == locked
        assert self.tree.evictable_size == len(self.ref) - locked
        assert self.tree.recount() == (self.tree.evictable_size, self.tree.locked_size)

    @invariant()
    def slots_match_model(self) -> None:
        slots = self.tree.all_slots().tolist()
        assert sorted(slots) == sorted(self.ref.values())

    def teardown(self) -> None:
        for node, _, _ in self.locks:
            self.tree.unlock(node)
        assert self.tree.locked_size == 0
        assert self.tree.evict(10**6).numel() == len(self.ref)
        assert self.tree.total_size == 0


RadixTreeMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixTreeStateful = RadixTreeMachine.TestCase
