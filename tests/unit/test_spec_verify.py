"""Tree verification: greedy speculation reproduces plain greedy decoding token for token, and
sampling acceptance leaves the target distribution unchanged (chi-square)."""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.attention.base import ancestor_mask
from phloem.runtime.cache.allocator import TokenSlotAllocator
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.speculative.decoding import NgramDrafter, SpeculativeDecoder, target_prefill
from phloem.runtime.speculative.ngram import NgramProposer
from phloem.runtime.speculative.tree import DraftTree
from phloem.runtime.speculative.verify import (
    SpecSampling,
    TreeVerifier,
    VerifyRequest,
    accept_greedy,
    accept_sampling,
    target_probs,
)

from tests.unit.tiny_model import tiny_runner

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return tiny_runner(1)


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 9, 10], [100, 200, 300, 100, 200], [3, 3, 3, 3, 3, 3, 3, 3]]


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of ``counts`` against ``probs`` (bins with expected count < 5 are merged)."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep].double(), exp[keep].double()
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), stat / 2))


# ---------------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize(
    "parents, expected",
    [
        ([-1], [[1]]),
        ([-1, 0, 1, 2], [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]),
        ([-1, 0, 0, 1, 1, 2], [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                               [1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 1]]),
    ],
)  # fmt: skip
def test_ancestor_mask(parents, expected):
    assert ancestor_mask(parents).int().tolist() == expected


def test_tree_rejects_bad_parents():
    with pytest.raises(ValueError):
        DraftTree([1, 2], [-1, 1])
    assert DraftTree([1, 2, 3], [-1, 0, 0]).depths == [0, 1, 1]


@pytest.mark.parametrize(
    "tokens, parents, target, nodes, out",
    [
        ([9], [-1], [4], [0], [4]),  # no drafts: a plain decode step
        ([9, 4, 5], [-1, 0, 1], [4, 5, 6], [0, 1, 2], [4, 5, 6]),  # whole chain + bonus
        ([9, 4, 5], [-1, 0, 1], [4, 7, 6], [0, 1], [4, 7]),  # rejected at depth 2
        ([9, 3, 4, 5, 6], [-1, 0, 0, 2, 2], [4, 0, 6, 0, 8], [0, 2, 4], [4, 6, 8]),  # second branch
    ],
)
def test_accept_greedy(tokens, parents, target, nodes, out):
    assert accept_greedy(DraftTree(tokens, parents), target) == (nodes, out)


def _probs(v: int, seed: int, sharp: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(v, generator=g) * sharp, dim=-1)


def test_sampling_chain_with_draft_distribution_matches_target():
    """Standard rule: draft x ~ q accepted w.p. min(1, p/q), else draw from max(p - q, 0)."""
    v, draws = 12, 6000
    p, q = _probs(v, 1), _probs(v, 2)
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(v)
    accepted = 0
    for _ in range(draws):
        x = int(torch.multinomial(q, 1, generator=gen))
        tree = DraftTree.chain(0, [x], draft_probs=torch.stack([q, q]))
        nodes, tokens = accept_sampling(tree, torch.stack([p, p]), gen)
        counts[tokens[0]] += 1
        accepted += len(nodes) > 1
    assert chi_square_pvalue(counts, p) > 1e-3
    expected_rate = float(torch.minimum(p, q).sum())  # P(accept) = sum min(p, q)
    assert abs(accepted / draws - expected_rate) < 0.03


def test_sampling_tree_with_deterministic_children_matches_target():
    """Point-mass rule over several siblings (top-k drafts), two levels deep."""
    v, draws = 10, 6000
    probs = torch.stack([_probs(v, s) for s in range(5)])
    tree = DraftTree([0, 3, 5, 1, 2], [-1, 0, 0, 1, 1])  # root -> {3, 5}; 3 -> {1, 2}
    gen = torch.Generator().manual_seed(7)
    first = torch.zeros(v)
    second_after_3 = torch.zeros(v)
    for _ in range(draws):
        nodes, tokens = accept_sampling(tree, probs, gen)
        first[tokens[0]] += 1
        if tokens[0] == 3:
            second_after_3[tokens[1]] += 1
    assert chi_square_pvalue(first, probs[0]) > 1e-3
    assert chi_square_pvalue(second_after_3, probs[1]) > 1e-3  # node 1 (token 3) owns probs[1]


def test_target_probs_follow_sampler_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    p = target_probs(logits, SpecSampling(temperature=1.0, top_k=2))
    assert torch.count_nonzero(p).item() == 2 and abs(float(p.sum()) - 1) < 1e-6
    p = target_probs(logits, SpecSampling(temperature=0.5, top_p=0.5))
    assert torch.count_nonzero(p).item() == 1


# ---------------------------------------------------------------------------------- on a model
def _reference(runner: ModelRunner, prompts, n: int) -> list[list[int]]:
    b = DirectBatcher(runner)
    return [b.generate_greedy(p, n) for p in prompts]


def test_ngram_greedy_equals_plain_greedy(runner):
    refs = _reference(runner, PROMPTS, 40)
    dec = SpeculativeDecoder(runner, NgramDrafter(NgramProposer(4)))
    outs = dec.generate(PROMPTS, 40)
    assert [o.tokens for o in outs] == refs
    assert dec.allocator.available_size == dec.allocator.total_size  # every slot came back
    assert runner.req_to_token_pool.available_size == runner.req_to_token_pool.size


class OracleDrafter:
    """Knows the greedy answer: drafts a tree holding the right path (up to ``depth``) among wrong
    siblings, and a wrong token after it, so acceptance stops inside the tree."""

    def __init__(self, prompts, refs, depth: int = 3) -> None:
        self.full = {tuple(p): r for p, r in zip(prompts, refs)}
        self.depth = depth
        self.rows: dict[int, tuple[int, ...]] = {}

    def start(self, seq, tokens, hidden):
        self.rows[seq] = tuple(tokens[:-1])

    def propose(self, seq, context):
        prompt = self.rows[seq]
        ref = self.full[prompt]
        done = len(context) - len(prompt)
        right = ref[done : done + self.depth]
        tokens, parents = [context[-1]], [-1]
        parent = 0
        for t in right:
            tokens += [(t + 1) % 512, t]  # a wrong sibling first, then the right token
            parents += [parent, parent]
            parent = len(tokens) - 1
        tokens.append((ref[done + len(right)] + 7) % 512 if done + len(right) < len(ref) else 0)
        parents.append(parent)
        return DraftTree(tokens, parents)

    def propose_many(self, seqs, contexts):
        return [self.propose(s, c) for s, c in zip(seqs, contexts)]

    def update(self, seq, result):
        pass

    def update_many(self, seqs, results):
        pass

    def draft_ahead(self, seqs, roots):
        pass

    def release(self, seq):
        self.rows.pop(seq, None)


def test_tree_greedy_equals_plain_greedy_and_accepts_paths(runner):
    refs = _reference(runner, PROMPTS, 30)
    dec = SpeculativeDecoder(runner, OracleDrafter(PROMPTS, refs, depth=3))
    outs = dec.generate(PROMPTS, 30)
    assert [o.tokens for o in outs] == refs
    for o in outs:
        assert o.accept_lengths[:-1] == [4] * (len(o.accept_lengths) - 1)  # 3 drafts + bonus
    assert dec.allocator.available_size == dec.allocator.total_size


def test_verify_caps_at_max_accept_and_commits_consecutive_slots(runner):
    refs = _reference(runner, PROMPTS[:1], 8)
    alloc = TokenSlotAllocator(runner.kv_pool.num_slots)
    row = runner.req_to_token_pool.alloc()
    try:
        prompt = PROMPTS[0]
        target_prefill(runner, [row], [prompt], [alloc.alloc(len(prompt))])
        tree = DraftTree([refs[0][0], 1, refs[0][1], refs[0][2]], [-1, 0, 0, 2])
        slots = alloc.alloc(len(tree))
        res = TreeVerifier(runner).verify([VerifyRequest(row, len(prompt), tree, slots, max_accept=2)])[0]
        assert res.tokens == refs[0][1:3] and res.nodes == [0, 2]
        table = runner.req_to_token_pool.req_to_token
        assert table[row, len(prompt) : len(prompt) + 2].tolist() == [int(slots[0]), int(slots[2])]
        assert sorted(res.free_slots.tolist()) == sorted([int(slots[1]), int(slots[3])])
    finally:
        runner.req_to_token_pool.free(row)


def test_sampled_first_token_matches_target_distribution(runner):
    """Speculation on (a tree holding the target's three likeliest tokens as siblings, the best
    one with a child): the first emitted token is distributed as the target's next token."""
    prompt = PROMPTS[1]
    sampling = SpecSampling(temperature=1.0, top_k=6)
    alloc = TokenSlotAllocator(runner.kv_pool.num_slots)
    row, ref_row = runner.req_to_token_pool.alloc(), runner.req_to_token_pool.alloc()
    try:
        logits, _ = target_prefill(runner, [row], [prompt], [alloc.alloc(len(prompt))])
        root = int(logits[0].argmax())
        # the target's distribution after prompt + root, from a plain extend on another row
        ref_logits, _ = target_prefill(runner, [ref_row], [[*prompt, root]], [alloc.alloc(len(prompt) + 1)])
        p = target_probs(ref_logits, sampling)[0]
        top = p.topk(3).indices.tolist()
        tree = DraftTree([root, top[1], top[0], top[2], top[0]], [-1, 0, 0, 0, 2])
        verifier = TreeVerifier(runner, seed=11)
        counts = torch.zeros_like(p)
        longer = 0
        for _ in range(1500):
            slots = alloc.alloc(len(tree))
            res = verifier.verify([VerifyRequest(row, len(prompt), tree, slots, sampling)])[0]
            counts[res.tokens[0]] += 1
            longer += res.accept_length > 1
            alloc.free(slots)  # every node's slot, committed or not: the next draw starts over
        assert chi_square_pvalue(counts, p) > 1e-3
        assert longer > 0  # drafts were accepted along the way
    finally:
        runner.req_to_token_pool.free(row)
        runner.req_to_token_pool.free(ref_row)


@pytest.mark.parametrize("drafter", ["oracle", "ngram"])
def test_padded_verify_pass_equals_per_request_pass(runner, drafter):
    """The CUDA verify layout (trees padded to a fixed width, one pass over all requests; run here
    eagerly with the plain-torch tree attention) gives the same tokens and accept lengths."""
    from phloem.runtime.executor.verify_graph import VerifyGraphRunner

    refs = _reference(runner, PROMPTS, 24)
    make = (lambda: OracleDrafter(PROMPTS, refs, depth=3)) if drafter == "oracle" else (
        lambda: NgramDrafter(NgramProposer(4)))  # fmt: skip
    plain = SpeculativeDecoder(runner, make()).generate(PROMPTS, 24)
    dec = SpeculativeDecoder(runner, make())
    dec.verifier.graphs = VerifyGraphRunner(runner, nodes=9, max_bs=0)  # 9 > any tree here: padding
    padded = dec.generate(PROMPTS, 24)
    assert [o.tokens for o in padded] == [o.tokens for o in plain] == refs
    assert [o.accept_lengths for o in padded] == [o.accept_lengths for o in plain]
    assert dec.allocator.available_size == dec.allocator.total_size
