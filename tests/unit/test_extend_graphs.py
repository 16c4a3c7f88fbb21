"""Short extend passes through the verify pass's padded chain layout (``executor/extend_graphs.py``)
give the logits of the plain extend and write the same K/V; anything they cannot hold runs eagerly.
On the CPU the padded pass runs eagerly with the plain-torch tree attention (the CUDA graphs are
checked in ``tests/kernels/test_extend_graphs_cuda.py``)."""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.executor.extend_graphs import ExtendGraphs
from phloem.runtime.executor.model_runner import DirectBatcher

from .tiny_model import tiny_runner


@pytest.fixture(scope="module")
def runner():
    torch.set_num_threads(1)
    return tiny_runner(3)


@pytest.fixture
def batchers(runner):
    """Make batchers whose sequences are released after the test."""
    made = []

    def make():
        made.append(DirectBatcher(runner))
        return made[-1]

    yield make
    for b in made:
        for seq in list(b.tokens):
            b.release(seq)


def _two_copies(make, prompts):
    """Two copies of the same sequences (their prompts' KV in the pool), one per path; one batcher,
    whose slots never repeat, so each copy writes and reads its own KV."""
    b = make()
    first, second = ([b.new_sequence() for _ in prompts] for _ in range(2))
    b.logits(dict(zip(first + second, prompts + prompts)))
    return (b, first), (b, second)


def test_chain_pass_equals_plain_extend(runner, batchers):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 2)]
    new = [torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist() for n in (1, 6, 4)]
    (plain, ps), (short, ss) = _two_copies(batchers, prompts)
    want = plain.logits(dict(zip(ps, new)))
    fi = short.build(dict(zip(ss, new)))
    graphs = ExtendGraphs(runner, width=6, max_bs=4)
    assert graphs.can_run(fi, wants_rows=False)
    got = graphs.logits(fi)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the K/V the chain wrote is what the extend wrote: the next decode step agrees
    nxt = want.argmax(-1).tolist()
    torch.testing.assert_close(
        short.logits({s: [t] for s, t in zip(ss, nxt)}, decode=True),
        plain.logits({s: [t] for s, t in zip(ps, nxt)}, decode=True),
        atol=1e-4, rtol=1e-4,
    )  # fmt: skip


def test_what_the_graphs_cannot_hold_runs_eagerly(runner, batchers):
    b = batchers()
    seqs = [b.new_sequence() for _ in range(3)]
    graphs = ExtendGraphs(runner, width=4, max_bs=2)
    assert not graphs.can_run(b.build({seqs[0]: [1, 2, 3, 4, 5]}), wants_rows=False)  # wider than 4
    assert not graphs.can_run(b.build({s: [7] for s in seqs}), wants_rows=False)  # 3 requests > 2
    fi = b.build({seqs[0]: [9]})
    assert graphs.can_run(fi, wants_rows=False)
    assert not graphs.can_run(fi, wants_rows=True)  # input logprobs need every row's logits
    assert not graphs.can_run(b.build({seqs[1]: [3]}, decode=True), wants_rows=False)  # decode


def test_model_runner_takes_the_chain_pass_for_short_extends(runner, batchers, monkeypatch):
    """``ModelRunner.forward`` routes a short extend to ``extend_graphs`` and samples its logits."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist() for n in (8, 3)]
    new = [[11, 12, 13], [14]]
    (plain, ps), (short, ss) = _two_copies(batchers, prompts)
    want = plain.step(dict(zip(ps, new))).synchronize()
    graphs = ExtendGraphs(runner, width=4, max_bs=2)
    calls = []
    monkeypatch.setattr(graphs, "logits", lambda fi, f=graphs.logits: calls.append(fi.batch_size) or f(fi))
    monkeypatch.setattr(runner, "extend_graphs", graphs)
    got = short.step(dict(zip(ss, new))).synchronize()
    assert calls == [2] and got == want
