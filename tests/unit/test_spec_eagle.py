"""EAGLE draft head: tree construction, tree-mask drafting, catch-up, save/load, and greedy
speculation through the head reproducing plain greedy decoding (tiny random models)."""

from __future__ import annotations

import copy

import pytest
import torch
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.speculative.decoding import EagleDrafter, SpeculativeDecoder
from phloem.runtime.speculative.eagle import (
    EagleConfig,
    EagleDraftWorker,
    EagleHead,
    load_eagle_head,
    save_eagle_head,
)
from phloem.runtime.speculative.tree import DraftTree

from tests.oracles import eagle_reference as oracle
from tests.unit.tiny_model import tiny_runner

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return tiny_runner(1)


def make_head(runner: ModelRunner, *, draft_vocab: int | None = None, seed: int = 0) -> EagleHead:
    head = EagleHead(EagleConfig.from_target(runner.model_config, draft_vocab_size=draft_vocab))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)  # random, non-degenerate
    if draft_vocab:
        head.token_map = torch.randperm(runner.vocab_size, generator=gen)[:draft_vocab].sort().values
    return head.eval()


def worker_for(runner, head, **kw) -> EagleDraftWorker:
    return EagleDraftWorker.for_runner(head, runner, **kw)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300, 100, 200], [42, 17]]


# ---------------------------------------------------------------------------------- tree building
def test_select_keeps_best_nodes_closed_under_parents(runner):
    w = worker_for(runner, make_head(runner), num_steps=3, topk=2, num_draft_tokens=4)
    nodes = [
        oracle.Node(9, -1, 0.0, 0),
        oracle.Node(1, 0, -0.1, 1),  # 1
        oracle.Node(2, 0, -2.0, 1),  # 2
        oracle.Node(3, 1, -0.1, 2),  # 3: ties with its parent: the parent must still come first
        oracle.Node(4, 1, -3.0, 2),  # 4
        oracle.Node(5, 2, -2.5, 2),  # 5
        oracle.Node(6, 3, -0.5, 3),  # 6
    ]
    tree = oracle.select(w, nodes)
    assert tree.tokens == [9, 1, 3, 6] and tree.parents == [-1, 0, 1, 2]


@pytest.mark.parametrize(
    "num_steps, topk, num_draft_tokens, size",
    [(3, 1, None, 4), (4, 1, 3, 3), (3, 2, 6, 6), (4, 4, 8, 8), (2, 3, 100, 1 + 3 + 9), (1, 4, 3, 3)],
)
def test_draft_tree_shapes(runner, num_steps, topk, num_draft_tokens, size):
    w = worker_for(
        runner, make_head(runner), num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens
    )
    w.prefill(0, PROMPTS[0], torch.randn(len(PROMPTS[0]) - 1, runner.model_config.hidden_size))
    tree = oracle.draft(w, 0, PROMPTS[0][-1])
    assert isinstance(tree, DraftTree) and len(tree) == size
    assert tree.tokens[0] == PROMPTS[0][-1] and max(tree.depths) <= num_steps
    if topk == 1:
        assert tree.parents == list(range(-1, size - 1))


def test_chain_draft_equals_step_by_step_extension(runner):
    """A chain drafted with temporary tree KV equals feeding each argmax token back through the
    committed path with the predicted feature (checks positions and masks of the tree path)."""
    head = make_head(runner, draft_vocab=256)
    w = worker_for(runner, head, num_steps=4, topk=1)
    h = runner.model_config.hidden_size
    w.prefill(0, PROMPTS[0], torch.randn(len(PROMPTS[0]) - 1, h, generator=torch.Generator().manual_seed(0)))
    chain = oracle.draft(w, 0, PROMPTS[0][-1]).tokens[1:]
    ref = copy.deepcopy(w)
    manual = []
    for _ in range(4):
        g = ref.root_feature(0)
        tok = int(ref.token_map[torch.nn.functional.linear(g[None], ref.lm_weight).argmax(-1)])
        manual.append(tok)
        ref.extend(0, [tok], g[None])
    assert chain == manual


def test_sibling_expansion_matches_separate_paths(runner):
    """With topk=2, each expanded level-2 node must not see its sibling: its children equal those
    of a chain drafted from the same path alone."""
    head = make_head(runner, draft_vocab=256)
    h = runner.model_config.hidden_size
    feats = torch.randn(len(PROMPTS[1]) - 1, h, generator=torch.Generator().manual_seed(1))
    w = worker_for(runner, head, num_steps=3, topk=2, num_draft_tokens=100)
    w.prefill(0, PROMPTS[1], feats)
    tree = oracle.draft(w, 0, PROMPTS[1][-1])
    children = tree.children()
    for c in children[0]:  # level-1 nodes (both expanded: topk == 2)
        ref = copy.deepcopy(w)
        ref.extend(0, [tree.tokens[c]], ref.root_feature(0)[None])
        top2 = ref.token_map[
            torch.nn.functional.linear(ref.root_feature(0)[None], ref.lm_weight).topk(2).indices[0]
        ].tolist()
        assert sorted(tree.tokens[k] for k in children[c]) == sorted(top2)


def test_catch_up_in_pieces_equals_one_pass(runner):
    head = make_head(runner)
    h = runner.model_config.hidden_size
    tokens = [3, 9, 27, 81, 243, 217, 139, 5]
    feats = torch.randn(len(tokens), h, generator=torch.Generator().manual_seed(2))
    a, b = worker_for(runner, head), worker_for(runner, head)
    a.extend(0, tokens, feats)
    b.extend(0, tokens[:3], feats[:3])
    b.extend(0, tokens[3:4], feats[3:4])
    b.extend(0, tokens[4:], feats[4:])
    torch.testing.assert_close(a.root_feature(0), b.root_feature(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.cache.get(0)[0], b.cache.get(0)[0], atol=1e-5, rtol=1e-5)


def test_save_load_round_trip(runner, tmp_path):
    head = make_head(runner, draft_vocab=100)
    path = str(tmp_path / "head.safetensors")
    save_eagle_head(head, path, dtype=torch.float32, info={"note": "test"})
    back = load_eagle_head(path)
    assert back.cfg == head.cfg and torch.equal(back.token_map, head.token_map)
    for (k, v), (_, u) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(v, u), k


# ---------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("num_steps, topk, num_draft_tokens", [(3, 1, 4), (3, 3, 8)])
def test_eagle_greedy_equals_plain_greedy(runner, num_steps, topk, num_draft_tokens):
    b = DirectBatcher(runner)
    refs = [b.generate_greedy(p, 24) for p in PROMPTS]
    w = worker_for(runner, make_head(runner, draft_vocab=128), num_steps=num_steps, topk=topk,
                   num_draft_tokens=num_draft_tokens)  # fmt: skip
    dec = SpeculativeDecoder(runner, EagleDrafter(w))
    outs = dec.generate(PROMPTS, 24)
    assert [o.tokens for o in outs] == refs
    assert dec.allocator.available_size == dec.allocator.total_size
    assert not w.cache.lens  # every sequence's draft cache was released
