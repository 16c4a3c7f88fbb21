"""Batched EAGLE drafting and catch-up against their per-sequence references: ``draft_many`` grows
the same trees as ``draft``, ``extend_many`` leaves the same cache and root features as ``extend``,
and the dense draft cache hands rows out, grows and takes them back (tiny random models, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from phloem.runtime.executor.model_runner import ModelRunner
from phloem.runtime.speculative.eagle import EagleConfig, EagleDraftWorker, EagleHead

from tests.oracles import eagle_reference as oracle
from tests.unit.tiny_model import tiny_runner

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return tiny_runner(1)


def random_worker(runner: ModelRunner, *, seed: int = 0, draft_vocab: int = 256, **kw) -> EagleDraftWorker:
    head = EagleHead(EagleConfig.from_target(runner.model_config, draft_vocab_size=draft_vocab))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    head.token_map = torch.randperm(runner.vocab_size, generator=gen)[:draft_vocab].sort().values
    return EagleDraftWorker.for_runner(head.eval(), runner, **kw)


def start(
    w: EagleDraftWorker, seqs: list[int], lengths: list[int], *, seed: int = 0, offset: int = 0
) -> None:
    """Prefill each sequence with random tokens and features (``offset``: prefix-cache start of
    the odd sequences)."""
    gen = torch.Generator().manual_seed(seed)
    h = w.head.cfg.hidden_size
    for s, n in zip(seqs, lengths):
        tokens = torch.randint(0, w.embed_weight.shape[0], (n,), generator=gen).tolist()
        w.prefill(s, tokens, torch.randn(n - 1, h, generator=gen), start=offset if s % 2 else 0)


def catch_up_inputs(w: EagleDraftWorker, counts: list[int], seed: int) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, w.embed_weight.shape[0], (n,), generator=gen).tolist() for n in counts]
    return tokens, [torch.randn(n, w.head.cfg.hidden_size, generator=gen) for n in counts]


def assert_same_state(a: EagleDraftWorker, b: EagleDraftWorker, seqs: list[int]) -> None:
    for s in seqs:
        assert a.cache.lens[s] == b.cache.lens[s]
        for x, y in zip(a.cache.get(s), b.cache.get(s)):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.root_feature(s), b.root_feature(s), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------- drafting
@pytest.mark.parametrize(
    "num_steps, topk, num_draft_tokens",
    [(3, 1, None), (5, 1, 4), (1, 4, 3), (2, 3, 100), (3, 3, 8), (4, 4, 8), (4, 4, 1)],
)
def test_draft_many_equals_per_request_draft(runner, num_steps, topk, num_draft_tokens):
    w = random_worker(runner, num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens)
    seqs = [3, 0, 5, 1, 6]  # not in row order; committed lengths 1 .. 40
    start(w, seqs, [9, 2, 40, 17, 5], offset=3)
    roots = [11, 12, 13, 14, 15]
    for step in range(3):
        tokens, scores, parents = w._grow_many(seqs)  # every candidate, not only the kept ones
        trees = w.draft_many(seqs, roots)
        for b, (s, root, tree) in enumerate(zip(seqs, roots, trees)):
            nodes = oracle.grow(w, s, root)[1:]
            assert tokens[b].tolist() == [n.token for n in nodes], (step, s)
            assert parents[b].tolist() == [n.parent for n in nodes], (step, s)
            want = torch.tensor([n.score for n in nodes], dtype=torch.float64)
            torch.testing.assert_close(scores[b], want, atol=1e-4, rtol=1e-4)
            ref = oracle.draft(w, s, root)
            assert (tree.tokens, tree.parents) == (ref.tokens, ref.parents), (step, s)
        # commit a different number of tokens per sequence, as verify would
        tokens, feats = catch_up_inputs(w, [1 + (i + step) % 3 for i in range(len(seqs))], seed=step)
        w.extend_many(seqs, tokens, feats)
        roots = [t[-1] for t in tokens]


def test_draft_many_of_a_subset_and_of_one(runner):
    w = random_worker(runner, seed=3, num_steps=3, topk=2, num_draft_tokens=6)
    start(w, [0, 1, 2], [6, 30, 12])
    full = [(t.tokens, t.parents) for t in w.draft_many([0, 1, 2], [1, 2, 3])]
    assert [(t.tokens, t.parents) for t in w.draft_many([2, 0], [3, 1])] == [full[2], full[0]]
    assert [(t.tokens, t.parents) for t in w.draft_many([1], [2])] == [full[1]]
    assert w.draft_many([], []) == []


# ---------------------------------------------------------------------------------- catch-up
def test_extend_many_equals_per_sequence_extend(runner):
    a = random_worker(runner, seed=1)
    start(a, [0, 1, 2, 3], [4, 20, 9, 2], offset=2)
    b = copy.deepcopy(a)
    seqs = [2, 0, 7, 3, 1]  # 7 is new: extend_many may start a sequence too
    for step, counts in enumerate([[1, 3, 5, 2, 4], [4, 1, 1, 1, 2], [1, 1, 1, 1, 1]]):
        tokens, feats = catch_up_inputs(a, counts, seed=10 + step)
        a.extend_many(seqs, tokens, feats)
        for s, t, f in zip(seqs, tokens, feats):
            b.extend(s, t, f)
        assert_same_state(a, b, [0, 1, 2, 3, 7])


def test_extend_many_grows_rows_and_length(runner):
    a = random_worker(runner, seed=2)
    b = copy.deepcopy(a)
    rows0, length0 = a.cache.capacity
    seqs = list(range(rows0 + 3))
    tokens, feats = catch_up_inputs(a, [length0 + 5 if s == 1 else 3 for s in seqs], seed=4)
    a.extend_many(seqs, tokens, feats)
    for s, t, f in zip(seqs, tokens, feats):
        b.extend(s, t, f)
    assert a.cache.capacity[0] > rows0 and a.cache.capacity[1] > length0
    assert_same_state(a, b, seqs)


# ---------------------------------------------------------------------------------- rows
def test_released_row_is_reused_without_leftovers(runner):
    w = random_worker(runner, seed=4, num_steps=3, topk=3, num_draft_tokens=8)
    start(w, [0, 1, 2], [30, 8, 12], seed=1)
    row = w.cache.row[1]
    w.release(1)
    assert 1 not in w.cache.lens and 1 not in w.cache.row
    start(w, [9], [5], seed=2)  # takes the freed row; its 30-entry predecessor left stale K/V there
    assert w.cache.row[9] == row
    fresh = random_worker(runner, seed=4, num_steps=3, topk=3, num_draft_tokens=8)
    start(fresh, [9], [5], seed=2)
    assert_same_state(w, fresh, [9])
    got, alone, ref = w.draft_many([0, 9, 2], [1, 2, 3])[1], fresh.draft_many([9], [2])[0], oracle.draft(w, 9, 2)
    assert (got.tokens, got.parents) == (alone.tokens, alone.parents) == (ref.tokens, ref.parents)
    for s in (0, 2, 9):
        w.release(s)
    assert not w.cache.lens and sorted(w.cache._free) == list(range(w.cache.capacity[0]))
