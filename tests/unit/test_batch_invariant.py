"""Deterministic mode: a sequence's logits are bit-identical in any batch and however its prefix
was computed (alone, batched with others of any length, extend over a cached prefix, decode).

Small random-weight Llama and Qwen3 models through ``ModelRunner(deterministic=True)``.
"""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.layers.linear import linear_rows
from phloem.runtime.model_files import ModelSource

MODELS = ["tiny-llama", "tiny-qwen3"]


@pytest.fixture(scope="module", autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


_RUNNERS: dict[tuple[str, int], ModelRunner] = {}


def runner_for(name: str, threads: int) -> ModelRunner:
    if (name, threads) not in _RUNNERS:
        _RUNNERS[name, threads] = ModelRunner(
            ModelSource("dummy", name), dtype="float32", device="cpu", max_total_tokens=8192,
            max_running_requests=24, sampler=lambda logits, info: logits.argmax(-1), deterministic=True,
            cpu_threads=threads,
        )  # fmt: skip
    torch.set_num_threads(threads)
    return _RUNNERS[name, threads]


def ids(n: int, seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


@pytest.fixture(params=[(m, t) for m in MODELS for t in (1, 2)], ids=lambda p: f"{p[0]}-threads{p[1]}")
def batcher(request) -> DirectBatcher:
    b = DirectBatcher(runner_for(*request.param))
    yield b
    for seq in list(b.tokens):
        b.release(seq)


def test_linear_rows_is_row_invariant() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(96, 64), torch.randn(37, 64)
    full = linear_rows(x, w, tile=16)
    torch.testing.assert_close(full, x @ w.T, atol=1e-4, rtol=0)
    for lo, hi in [(0, 1), (5, 6), (3, 20), (17, 37)]:
        assert torch.equal(linear_rows(x[lo:hi], w, tile=16), full[lo:hi])


def test_same_logits_in_any_batch(batcher: DirectBatcher) -> None:
    vocab = batcher.runner.vocab_size
    target = ids(40, 0, vocab)

    # 1. alone: one prefill, then decode steps
    s = batcher.new_sequence()
    alone = [batcher.logits({s: target[:30]})]
    alone += [batcher.logits({s: [t]}, decode=True) for t in target[30:]]
    alone_t = torch.cat(alone)  # [11, V]: after token 29, 30, ..., 39

    # 2. prefill inside a batch of other prompts, then decode inside batches of changing size
    others = {batcher.new_sequence(): ids(n, 10 + n, vocab) for n in (3, 17, 60)}
    t2 = batcher.new_sequence()
    got = [batcher.logits({**others, t2: target[:30]})[-1:]]
    others_decode = list(others)
    for i, tok in enumerate(target[30:]):
        batch = {o: [7 + i] for o in others_decode[: i % 4]}
        batch[t2] = [tok]
        if i % 2:
            batch = dict(reversed(list(batch.items())))  # other position in the batch
        out = batcher.logits(batch, decode=True)
        got.append(out[list(batch).index(t2)][None])
    assert torch.equal(torch.cat(got), alone_t)

    # 3. extend over a cached prefix (as after a radix hit), mixed with a decode-like row
    t3, busy = batcher.new_sequence(), batcher.new_sequence()
    batcher.logits({t3: target[:12], busy: ids(9, 5, vocab)})
    out = batcher.logits({busy: [11], t3: target[12:30]})
    assert torch.equal(out[1:], alone_t[:1])

    # 4. token by token from the start (every logit row of the prompt, via decode steps)
    t4 = batcher.new_sequence()
    batcher.logits({t4: target[:1]})
    rows = [batcher.logits({t4: [t]}, decode=True) for t in target[1:30]]
    assert torch.equal(rows[-1], alone_t[:1])


def test_greedy_tokens_match_across_batches(batcher: DirectBatcher) -> None:
    vocab = batcher.runner.vocab_size
    prompt = ids(21, 3, vocab)
    alone = batcher.generate_greedy(prompt, 8)
    seqs = [batcher.new_sequence() for _ in range(5)]
    first = batcher.step({s: (prompt if k == 2 else ids(5 + 7 * k, k, vocab)) for k, s in enumerate(seqs)})
    tokens = first.synchronize()
    out = [tokens[2]]
    for _ in range(7):
        tokens = batcher.step({s: [t] for s, t in zip(seqs, tokens)}, decode=True).synchronize()
        out.append(tokens[2])
    assert out == alone
