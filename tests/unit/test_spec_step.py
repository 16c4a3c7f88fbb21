"""The scheduler-side collaborator, driven the way the scheduler patch drives it: plan, one
allocation, verify, free, append. Greedy output must equal plain greedy decoding, also when the
draft starts after a prefix-cache hit."""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.cache.allocator import TokenSlotAllocator
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.speculative.decoding import EagleDrafter, target_forward
from phloem.runtime.speculative.eagle import EagleConfig, EagleDraftWorker, EagleHead
from phloem.runtime.speculative.step import SpecRow, SpeculativeStep, build_speculative_step

from tests.unit.tiny_model import tiny_runner


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    torch.set_num_threads(1)
    return tiny_runner(1)


def _eagle_step(runner) -> SpeculativeStep:
    head = EagleHead(EagleConfig.from_target(runner.model_config))
    head.reset_parameters(torch.Generator().manual_seed(0))
    worker = EagleDraftWorker.for_runner(head, runner, num_steps=3, topk=2, num_draft_tokens=6)
    return SpeculativeStep(runner, EagleDrafter(worker), max_tree=6)


def _drive(runner, spec: SpeculativeStep, prompts, n: int, cached: int) -> list[list[int]]:
    """Scheduler-like loop; the first ``cached`` prompt tokens pretend to come from the tree."""
    alloc = TokenSlotAllocator(runner.kv_pool.num_slots)
    pool = runner.req_to_token_pool
    rows = [pool.alloc() for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    kv = [len(p) for p in prompts]
    logits, hidden = target_forward(runner, rows, prompts, [alloc.alloc(len(p)) for p in prompts])
    for i, (row, p) in enumerate(zip(rows, prompts)):
        outs[i].append(int(logits[i].argmax()))
        spec.on_extend(row, cached, hidden[i][cached:])  # as if positions < cached came from the tree
        spec.on_prefill_done(row, p, outs[i][0])
    while any(len(o) < n for o in outs):
        active = [i for i in range(len(prompts)) if len(outs[i]) < n]
        items = [
            SpecRow(rows[i], kv[i], [*prompts[i], *outs[i]], max_accept=n - len(outs[i])) for i in active
        ]
        need = spec.plan(items)
        results = spec.verify(items, alloc.alloc(need))
        for i, res in zip(active, results):
            alloc.free(res.free_slots)
            kv[i] += res.accept_length
            outs[i] += res.tokens
    for i, row in enumerate(rows):
        alloc.free(pool.req_to_token[row, : kv[i]].clone())
        spec.release(row)
        pool.free(row)
    assert alloc.available_size == alloc.total_size
    return outs


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 9, 10], [100, 200, 300, 100, 200, 7]]


@pytest.mark.parametrize("algorithm, cached", [("NGRAM", 0), ("EAGLE", 0), ("EAGLE", 4)])
def test_step_greedy_equals_plain(runner, algorithm, cached):
    b = DirectBatcher(runner)
    refs = [b.generate_greedy(p, 20) for p in PROMPTS]
    spec = (
        build_speculative_step(runner, "NGRAM", num_draft_tokens=4)
        if algorithm == "NGRAM"
        else _eagle_step(runner)
    )
    assert _drive(runner, spec, PROMPTS, 20, cached) == refs
    assert spec.verify_count > 0 and spec.mean_accept_length >= 1.0


def test_unknown_algorithm(runner):
    with pytest.raises(ValueError):
        build_speculative_step(runner, "MEDUSA")


def test_plain_steps_catch_the_drafter_up_like_one_update_per_row(runner):
    """``on_plain_steps`` (one batched catch-up for every row of a plain decode step) leaves the
    draft cache and root features as one ``update`` per row would."""
    from phloem.runtime.speculative.verify import VerifyResult

    gen = torch.Generator().manual_seed(3)
    h = runner.model_config.hidden_size
    prompts = {
        row: torch.randint(2, 500, (n,), generator=gen).tolist() for row, n in ((0, 5), (2, 9), (3, 7))
    }
    feats = {row: torch.randn(len(p) - 1, h, generator=gen) for row, p in prompts.items()}
    steps = [({row: int(torch.randint(2, 500, (1,), generator=gen)) for row in prompts},
              {row: torch.randn(1, h, generator=gen) for row in prompts}) for _ in range(3)]  # fmt: skip
    batched, single = _eagle_step(runner), _eagle_step(runner)
    for spec in (batched, single):
        for row, p in prompts.items():
            spec.drafter.worker.prefill(row, p, feats[row])  # type: ignore[attr-defined]
    rows = list(prompts)
    for tokens, hidden in steps:
        batched.on_plain_steps(rows, [tokens[r] for r in rows], [hidden[r] for r in rows])
        for r in rows:
            empty = torch.empty(0, dtype=torch.int64)
            single.drafter.update(r, VerifyResult([tokens[r]], [0], empty, hidden[r]))
    for r in rows:
        wb, ws = batched.drafter.worker, single.drafter.worker  # type: ignore[attr-defined]
        kb, vb = wb.cache.get(r)
        ks, vs = ws.cache.get(r)
        assert (
            kb.shape == ks.shape and torch.allclose(kb, ks, atol=1e-5) and torch.allclose(vb, vs, atol=1e-5)
        )
        assert torch.allclose(wb.root_feature(r), ws.root_feature(r), atol=1e-5)
