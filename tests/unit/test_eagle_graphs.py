"""The padded, fixed-shape EAGLE passes that CUDA graphs capture (``EagleGraphs``), run eagerly on
the CPU against the worker's own batched passes: same trees, same cache and root features, with
padded batches, key widths rounded up, the scratch row, fallbacks and cache growth."""

from __future__ import annotations

import copy

import pytest
import torch
from phloem.runtime.speculative.draft_graph import SCRATCH_SEQ
from phloem.runtime.speculative.eagle import EagleDraftWorker, _topk

from tests.unit.test_eagle_batch import assert_same_state, catch_up_inputs, random_worker, runner, start

__all__ = ["runner"]  # the module-scoped fixture, shared with test_eagle_batch


def twins(runner, **kw):  # noqa: ANN001, ANN201
    """An eager worker and a copy whose passes go through ``EagleGraphs`` (no capture)."""
    eager = random_worker(runner, **kw)
    padded = copy.deepcopy(eager)
    padded.use_graphs(8, capture=False)
    return eager, padded


def same_trees(a, b) -> None:  # noqa: ANN001
    assert [(t.tokens, t.parents) for t in a] == [(t.tokens, t.parents) for t in b]


@pytest.mark.parametrize("num_steps, topk, num_draft_tokens", [(4, 1, 5), (3, 3, 8), (4, 4, 8), (1, 2, 3)])
def test_padded_draft_and_catch_up_equal_the_eager_passes(runner, num_steps, topk, num_draft_tokens):
    eager, padded = twins(runner, seed=5, num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens)
    seqs = [3, 0, 5, 1, 6]  # padded to a batch of 8; committed lengths 2 .. 40
    for w in (eager, padded):
        start(w, seqs, [9, 2, 40, 17, 5], offset=3)
    roots = [11, 12, 13, 14, 15]
    for step in range(4):
        same_trees(eager.draft_many(seqs, roots), padded.draft_many(seqs, roots))
        # 1 .. num_steps + 1 tokens per sequence, as a verify commits
        counts = [1 + (i + step) % (num_steps + 1) for i in range(len(seqs))]
        tokens, feats = catch_up_inputs(eager, counts, seed=step)
        eager.extend_many(seqs, tokens, feats)
        padded.extend_many(seqs, tokens, feats)
        assert_same_state(eager, padded, seqs)
        roots = [t[-1] for t in tokens]
        seqs = seqs[: len(seqs) - step % 2] if len(seqs) > 2 else seqs  # the batch shrinks
    keys = set(padded.graphs.passes)
    assert {k[0] for k in keys} == {"draft", "extend"} and {k[1] for k in keys} <= {1, 2, 4, 8}
    assert all(k[2] >= 64 and k[2] & (k[2] - 1) == 0 for k in keys)  # widths: powers of two


def test_the_scratch_row_is_nobody_s(runner):
    _, padded = twins(runner, seed=6)
    pad = padded.graphs.pad_row
    start(padded, list(range(8)), [3] * 8)
    assert padded.cache.row[SCRATCH_SEQ] == pad and pad not in [padded.cache.row[s] for s in range(8)]
    padded.release(0)
    start(padded, [9], [4])
    assert padded.cache.row[9] != pad


def test_fallbacks_and_cache_growth(runner):
    eager, padded = twins(runner, seed=7, num_steps=3, topk=1, num_draft_tokens=4)
    seqs = list(range(10))  # more than the largest padded batch (8): the eager pass runs
    for w in (eager, padded):
        start(w, seqs, [3 + s for s in seqs])
    same_trees(eager.draft_many(seqs, seqs), padded.draft_many(seqs, seqs))
    assert not padded.graphs.passes
    few = seqs[:3]
    same_trees(eager.draft_many(few, few), padded.draft_many(few, few))
    before = dict(padded.graphs.passes)
    # a catch-up longer than num_steps + 1 tokens (not a verify's) also runs eagerly
    tokens, feats = catch_up_inputs(eager, [6, 1, 2], seed=1)
    eager.extend_many(few, tokens, feats)
    padded.extend_many(few, tokens, feats)
    assert padded.graphs.passes.keys() == before.keys()
    assert_same_state(eager, padded, few)
    # grow one sequence past the cache's length: the passes over the old storage are dropped
    length = padded.cache.capacity[1]
    for _ in range(length // 4 + 1):
        tokens, feats = catch_up_inputs(eager, [4, 1, 1], seed=2)
        eager.extend_many(few, tokens, feats)
        padded.extend_many(few, tokens, feats)
    assert padded.cache.capacity[1] > length
    assert all(p is not before.get(k) for k, p in padded.graphs.passes.items())
    assert_same_state(eager, padded, few)
    same_trees(eager.draft_many(few, [1, 2, 3]), padded.draft_many(few, [1, 2, 3]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_steps, topk, num_draft_tokens", [(4, 1, 5), (4, 4, 8)])
def test_captured_graphs_replay_the_padded_passes_exactly(runner, num_steps, topk, num_draft_tokens):
    """On CUDA the captured graphs give bit-identical trees, cache and root features to the same
    padded passes run eagerly, across replays with new inputs (and new key widths)."""
    cpu = random_worker(runner, seed=8, num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens)
    model = runner.model
    lm = model.lm_head.tied_to.weight if model.lm_head.tied_to is not None else model.lm_head.weight

    def on_cuda(capture: bool) -> EagleDraftWorker:
        w = EagleDraftWorker(copy.deepcopy(cpu.head), embed_weight=model.model.embed_tokens.weight.cuda(),
                             lm_head_weight=lm.cuda(), num_steps=num_steps, topk=topk,
                             num_draft_tokens=num_draft_tokens)  # fmt: skip
        w.use_graphs(8, capture=capture)
        return w

    graphs, eager = on_cuda(True), on_cuda(False)
    seqs = [3, 0, 5, 1, 6]
    gen = torch.Generator().manual_seed(0)
    for s, n in zip(seqs, [9, 2, 60, 17, 5]):
        tokens = torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist()
        feats = torch.randn(n - 1, cpu.head.cfg.hidden_size, generator=gen).cuda()
        for w in (graphs, eager):
            w.prefill(s, tokens, feats)
    roots = [11, 12, 13, 14, 15]
    for step in range(6):
        same_trees(graphs.draft_many(seqs, roots), eager.draft_many(seqs, roots))
        counts = [1 + (i + step) % (num_steps + 1) for i in range(len(seqs))]
        tokens, feats = catch_up_inputs(cpu, counts, seed=step)
        feats = [f.cuda() for f in feats]
        graphs.extend_many(seqs, tokens, feats)
        eager.extend_many(seqs, tokens, feats)
        for s in seqs:
            for x, y in zip(graphs.cache.get(s), eager.cache.get(s)):
                assert torch.equal(x, y)
            assert torch.equal(graphs.root_feature(s), eager.root_feature(s))
        roots = [t[-1] for t in tokens]
    assert graphs.graphs.captured >= 2 and all(p.graph is not None for p in graphs.graphs.passes.values())


@pytest.mark.parametrize("n, k", [(100, 1), (100, 3), (3000, 1), (3000, 4), (49152, 4), (50000, 8)])
def test_two_pass_topk_equals_topk(n, k):
    x = torch.randn(3, 5, n, generator=torch.Generator().manual_seed(n + k))
    got, want = _topk(x, k), x.topk(k, dim=-1)
    assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_head_kernels_match_the_torch_ops(runner):
    """At inference on CUDA the head's norms, rotation and SwiGLU are the runtime's fused kernels;
    with autograd on (training) they are torch ops. Both give the same features."""
    head = random_worker(runner, seed=9).head.cuda()
    gen = torch.Generator().manual_seed(1)
    h = head.cfg.hidden_size
    emb, feat = torch.randn(4, 3, h, generator=gen).cuda(), torch.randn(4, 3, h, generator=gen).cuda()
    positions = torch.arange(4, device="cuda")[:, None] + 5  # [4, 1]: broadcast over the 3 rows, as drafting does

    def run() -> torch.Tensor:
        x, q, k, v = head.project(emb, feat, positions)
        return head.finish(x, q)  # q stands in for the attention output: same shape

    with torch.inference_mode():
        fused = run()
    with torch.enable_grad():
        plain = run().detach()
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_head_norms_folded_into_its_projections_match_the_separate_kernels(runner):
    """In bfloat16 on CUDA the head's norms run inside its qkv and gate/up projections
    (``row_fused``, 12 rows here); with folding off they are separate kernels. Same features."""
    from phloem.runtime.layers.fusion import set_row_fusion

    head = random_worker(runner, seed=9).head.cuda().to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    h = head.cfg.hidden_size
    emb, feat = (torch.randn(4, 3, h, generator=gen).cuda().to(torch.bfloat16) for _ in range(2))
    positions = torch.arange(4, device="cuda")[:, None] + 5

    def run() -> torch.Tensor:
        x, q, k, v = head.project(emb, feat, positions)
        return head.finish(x, q).float()

    try:
        with torch.inference_mode():
            set_row_fusion(False)
            plain = run()
            set_row_fusion(True)
            folded = run()
    finally:
        set_row_fusion(True)
    err = float((folded - plain).norm() / plain.norm())
    assert err <= 2e-2, f"rel err {err:.2e}"


def test_trees_drafted_ahead_are_the_trees_drafted_on_demand(runner):
    """``draft_ahead`` then ``draft_many`` of any subset with the same roots gives the trees a
    fresh draft gives; a catch-up, a release or another root in between makes it draft afresh."""
    eager, ahead = twins(runner, seed=10, num_steps=3, topk=2, num_draft_tokens=6)
    seqs, roots = [4, 1, 6, 2], [21, 22, 23, 24]
    for w in (eager, ahead):
        start(w, seqs, [7, 12, 3, 30])
    calls: list[list[int]] = []
    draft = ahead.graphs.draft
    ahead.graphs.draft = lambda s: calls.append(s) or draft(s)  # type: ignore[method-assign]
    ahead.draft_ahead(seqs, roots)
    assert ahead._ahead is not None and calls == [seqs]
    same_trees(eager.draft_many([1, 2], [22, 24]), ahead.draft_many([1, 2], [22, 24]))
    assert len(calls) == 1 and ahead._ahead is None  # read from the ahead copy, which is used up
    ahead.draft_ahead(seqs, roots)
    same_trees(eager.draft_many(seqs, [21, 22, 23, 99]), ahead.draft_many(seqs, [21, 22, 23, 99]))
    assert calls[1:] == [seqs, seqs]  # a root changed: drafted afresh
    ahead.draft_ahead(seqs, roots)
    tokens, feats = catch_up_inputs(eager, [2], seed=3)
    for w in (eager, ahead):
        w.extend_many([6], tokens, feats)
    ahead.release(4)
    eager.release(4)
    assert set(ahead._ahead.rows) == {1, 2}  # 6 caught up, 4 left
    same_trees(eager.draft_many([1, 6], [22, 5]), ahead.draft_many([1, 6], [22, 5]))
    assert calls[-1] == [1, 6]
    same_trees(eager.draft_many([1, 2], [22, 24]), ahead.draft_many([1, 2], [22, 24]))
    assert calls[-1] == [1, 2]  # nothing left ahead


def test_a_reserved_cache_keeps_its_storage_and_passes(runner):
    """``reserve`` (serving: ``RESERVED_DRAFT_LENGTH``): catch-ups up to that length move no
    storage, so no pass is dropped (a drop on CUDA means a capture again, mid-run)."""
    _, padded = twins(runner, seed=8, num_steps=3, topk=1, num_draft_tokens=4)
    padded.use_graphs(8, capture=False, reserve=256)
    start(padded, [0, 1], [5, 9])
    storage = padded.graphs._storage
    roots = [3, 4]
    for step in range(40):  # lengths grow past 64 and 128
        padded.draft_many([0, 1], roots)
        tokens, feats = catch_up_inputs(padded, [4, 3], seed=step)
        padded.extend_many([0, 1], tokens, feats)
        roots = [t[-1] for t in tokens]
    assert padded.cache.lens[0] > 128 and padded.graphs._storage == storage
    assert {k[2] for k in padded.graphs.passes} >= {64, 128, 256}
