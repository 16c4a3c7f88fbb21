"""TokenSlotAllocator: slot 0 reserved, all-or-nothing allocation, O(len) free, double-free detection."""

from __future__ import annotations

import random

import pytest
import torch
from phloem.runtime.cache.allocator import SlotAllocatorError, TokenSlotAllocator


def test_sizes_and_padding_slot_never_handed_out() -> None:
    a = TokenSlotAllocator(9, check=True)
    assert (a.total_size, a.available_size) == (8, 8)
    got = a.alloc(8)
    assert got is not None and got.dtype == torch.int64 and got.shape == (8,)
    assert sorted(got.tolist()) == list(range(1, 9))
    assert a.available_size == 0


def test_alloc_is_all_or_nothing() -> None:
    a = TokenSlotAllocator(5, check=True)
    assert a.alloc(5) is None
    assert a.available_size == 4
    first = a.alloc(3)
    assert first is not None
    assert a.alloc(2) is None
    assert a.available_size == 1
    assert a.alloc(0) is not None and a.alloc(0).numel() == 0


def test_free_then_alloc_uses_freed_chunks() -> None:
    a = TokenSlotAllocator(11, check=True)
    x = a.alloc(6)
    y = a.alloc(4)
    assert x is not None and y is not None and a.available_size == 0
    a.free(x[:2])
    a.free(y)
    assert a.available_size == 6
    z = a.alloc(6)
    assert z is not None
    assert sorted(z.tolist()) == sorted(x[:2].tolist() + y.tolist())


def test_returned_tensor_is_not_mutated_by_later_calls() -> None:
    a = TokenSlotAllocator(8, check=True)
    x = a.alloc(3)
    assert x is not None
    saved = x.clone()
    a.free(x)
    a.alloc(7)
    assert torch.equal(x, saved)


def test_free_copies_its_argument() -> None:
    a = TokenSlotAllocator(6, check=True)
    x = a.alloc(5)
    assert x is not None
    row = x.clone()
    a.free(row)
    row.fill_(0)  # the caller reuses its buffer
    got = a.alloc(5)
    assert got is not None and sorted(got.tolist()) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param([1], id="already-free"),
        pytest.param([0], id="padding-slot"),
        pytest.param([6], id="out-of-range"),
        pytest.param([2, 2], id="repeated-in-one-call"),
    ],
)
def test_check_mode_rejects_bad_free(bad: list[int]) -> None:
    a = TokenSlotAllocator(6, check=True)
    held = a.alloc(3)  # slots 1, 2, 3 in order
    assert held is not None
    a.free(held[:1])
    before = a.available_size
    with pytest.raises(SlotAllocatorError):
        a.free(torch.tensor(bad, dtype=torch.int64))
    assert a.available_size == before


def test_without_check_mode_double_free_is_not_detected() -> None:
    a = TokenSlotAllocator(4)
    x = a.alloc(1)
    assert x is not None
    a.free(x)
    a.free(x)  # caller bug, silently accepted outside check mode
    assert a.available_size == 4


def test_reset_and_free_slots_snapshot() -> None:
    a = TokenSlotAllocator(6, check=True)
    x = a.alloc(4)
    assert x is not None
    a.free(x[1:3])
    assert sorted(a.free_slots().tolist()) == sorted([5] + x[1:3].tolist())
    a.reset()
    assert a.available_size == 5
    a.free(torch.empty(0, dtype=torch.int64))


def test_random_ops_never_hand_out_a_slot_twice() -> None:
    rng = random.Random(0)
    a = TokenSlotAllocator(65, check=True)
    held: list[torch.Tensor] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            a.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(0, 12)
            got = a.alloc(n)
            if got is None:
                assert n > a.available_size
            else:
                held.append(got)
        out = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        assert torch.unique(out).numel() == out.numel()
        assert out.numel() + a.available_size == a.total_size
    assert not bool((a.free_slots() == 0).any())
