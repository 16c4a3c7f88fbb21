"""Sibling deferral in the scheduler loop: a request sharing an uncached stem with one whose prompt
is being computed waits only when it can then read the stem from the tree."""

from __future__ import annotations

import pytest

from tests.unit.test_scheduler_loop import Harness, expected

STEM = list(range(7000, 7100))  # 100 shared tokens, well over the 32-token threshold


def add_siblings(h: Harness, n: int = 4, max_new: int = 20) -> list:
    return [h.add(f"s{i}", STEM + [i + 1, i + 2], max_new=max_new) for i in range(n)]


@pytest.mark.parametrize("overlap", [False, True])
def test_without_radix_cache_siblings_are_admitted_together(overlap):
    """Nothing is read back without a tree, so a sibling that waited would compute the whole stem
    anyway, only later: all four go into the first prefill pass."""
    h = Harness(pool=4096, overlap=overlap, radix=False)
    reqs = add_siblings(h)
    h.s.step()
    assert h.s.waiting == []
    assert all(r.req_pool_idx is not None for r in reqs)
    h.run()
    out = h.outputs()
    assert all(out[r.rid] == expected(102, 20) for r in reqs)
    assert all(r.cached_tokens == 0 for r in reqs)


@pytest.mark.parametrize("overlap", [False, True])
def test_with_radix_cache_siblings_still_wait_for_the_stem(overlap):
    h = Harness(pool=4096, overlap=overlap)
    reqs = add_siblings(h)
    h.s.step()
    assert len(h.s.waiting) == 3  # the first computes the stem, the others wait for it
    h.run()
    assert sorted(r.cached_tokens for r in reqs) == [0, 100, 100, 100]


@pytest.mark.parametrize("overlap", [False, True])
def test_siblings_wait_for_the_last_chunk_of_a_chunked_stem(overlap):
    """Chunks of 64: the first computes tokens 0-63, then 64-101. The siblings must wait for that
    last chunk too (it holds 36 more stem tokens) rather than compute them a second time."""
    h = Harness(pool=4096, overlap=overlap, chunk=64)
    reqs = add_siblings(h)
    h.run()
    out = h.outputs()
    assert all(out[r.rid] == expected(102, 20) for r in reqs)
    assert sorted(r.cached_tokens for r in reqs) == [0, 100, 100, 100]
