"""Grammar masks over draft trees: each node's row is the mask after its own path, the matcher is
left as it was found, and constrained speculative greedy output equals masked plain greedy output."""

from __future__ import annotations

import pytest
import torch
from phloem.grammars.bitmask import unpack_bitmask
from phloem.runtime.cache.allocator import TokenSlotAllocator
from phloem.runtime.executor.model_runner import ModelRunner
from phloem.runtime.speculative.decoding import NgramDrafter, target_forward
from phloem.runtime.speculative.grammar import tree_bitmask
from phloem.runtime.speculative.ngram import NgramProposer
from phloem.runtime.speculative.step import SpecRow, SpeculativeStep
from phloem.runtime.speculative.tree import DraftTree

from tests.unit.tiny_model import tiny_runner

VOCAB = 16
STOP = 15


class IncreasingMatcher:
    """Toy grammar: tokens strictly increase; STOP (after at least one token) terminates."""

    def __init__(self, accepted: list[int] | None = None) -> None:
        self.accepted = list(accepted or [])
        self.rollbacks = 0

    def _allowed(self) -> set[int]:
        if self.is_terminated():
            return {STOP}
        last = self.accepted[-1] if self.accepted else -1
        return set(range(last + 1, STOP)) | ({STOP} if self.accepted else set())

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self._allowed() or self.is_terminated():
            return False
        self.accepted.append(token_id)
        return True

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        word = sum(1 << t for t in self._allowed())
        bitmask[row] = torch.tensor([word if word < 2**31 else word - 2**32], dtype=torch.int32)

    def rollback(self, num_tokens: int) -> None:
        self.rollbacks += num_tokens
        del self.accepted[len(self.accepted) - num_tokens :]

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == STOP


def _allowed_rows(mask: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(r).flatten().tolist()) for r in unpack_bitmask(mask, VOCAB)]


def test_each_node_gets_the_mask_after_its_own_path():
    #        0:(3)
    #       /   |    \
    #   1:(5) 2:(2)  3:(9)        2 is ungrammatical (2 < 3): its subtree keeps "all allowed"
    #    |      |     |
    #   4:(7) 5:(4) 6:(STOP)      6 terminates: nothing follows it
    tree = DraftTree([3, 5, 2, 9, 7, 4, STOP], [-1, 0, 0, 0, 1, 2, 3])
    m = IncreasingMatcher([3])
    rows = _allowed_rows(tree_bitmask(tree, m, VOCAB))
    assert rows[0] == set(range(4, 16))
    assert rows[1] == set(range(6, 16))
    assert rows[3] == set(range(10, 16))
    assert rows[4] == set(range(8, 16))
    assert rows[2] == rows[5] == set(range(VOCAB))  # unreachable under the grammar
    assert rows[6] == set(range(VOCAB))  # after termination: never consulted
    assert m.accepted == [3] and m.rollbacks == 4  # 5, 7, 9, STOP were walked and undone


def test_chain_stops_at_first_ungrammatical_token():
    tree = DraftTree.chain(1, [2, 4, 3, 6])  # 3 breaks the order: 3 and 6 are unreachable
    rows = _allowed_rows(tree_bitmask(tree, IncreasingMatcher([1]), VOCAB))
    assert rows[:3] == [set(range(2, 16)), set(range(3, 16)), set(range(5, 16))]
    assert rows[3] == rows[4] == set(range(VOCAB))


class EvenMatcher:
    """Toy grammar over a real vocabulary: only even token ids, forever."""

    def __init__(self) -> None:
        self.n = 0

    def accept_token(self, token_id: int) -> bool:
        if token_id % 2:
            return False
        self.n += 1
        return True

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        bitmask[row] = 0x55555555  # bits 0, 2, 4, ...: even ids

    def rollback(self, num_tokens: int) -> None:
        self.n -= num_tokens

    def is_terminated(self) -> bool:
        return False


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    torch.set_num_threads(1)
    return tiny_runner(3, max_running_requests=4)


def _masked_greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    """Reference: recompute the whole context each step, argmax over even ids only."""
    alloc = TokenSlotAllocator(runner.kv_pool.num_slots)
    row = runner.req_to_token_pool.alloc()
    out: list[int] = []
    for _ in range(n):
        ctx = [*prompt, *out]
        slots = alloc.alloc(len(ctx))
        logits = target_forward(runner, [row], [ctx], [slots])[0].clone()
        logits[:, 1::2] = float("-inf")
        out.append(int(logits[0].argmax()))
        alloc.free(slots)
    runner.req_to_token_pool.free(row)
    return out


def test_constrained_speculative_greedy_equals_masked_plain_greedy(runner):
    prompt, n = [4, 6, 8, 4, 6, 8, 4, 6], 16
    ref = _masked_greedy(runner, prompt, n)
    assert all(t % 2 == 0 for t in ref)
    spec = SpeculativeStep(runner, NgramDrafter(NgramProposer(4)), max_tree=5)
    alloc = TokenSlotAllocator(runner.kv_pool.num_slots)
    row = runner.req_to_token_pool.alloc()
    assert row is not None
    logits = target_forward(runner, [row], [prompt], [alloc.alloc(len(prompt))])[0].clone()
    logits[:, 1::2] = float("-inf")
    out, kv, matcher = [int(logits[0].argmax())], len(prompt), EvenMatcher()
    matcher.accept_token(out[0])
    spec.on_prefill_done(row, prompt, out[0])
    while len(out) < n:
        item = SpecRow(row, kv, [*prompt, *out], max_accept=n - len(out), grammar=matcher)
        need = spec.plan([item])
        (res,) = spec.verify([item], alloc.alloc(need))
        alloc.free(res.free_slots)
        kv += res.accept_length
        assert all(matcher.accept_token(t) for t in res.tokens)  # the scheduler's part
        out += res.tokens
    assert out == ref
    assert spec.mean_accept_length > 1.0  # the repeating prompt gave n-gram drafts that held
    alloc.free(runner.req_to_token_pool.req_to_token[row, :kv].clone())
    runner.req_to_token_pool.free(row)
    assert alloc.available_size == alloc.total_size
