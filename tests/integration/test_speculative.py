"""Speculative decoding on the real default model (CPU): greedy output identical to plain greedy
decoding with the shipped EAGLE head (chain and tree) and with n-gram drafts."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup():
    from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
    from phloem.runtime.model_files import resolve_model
    from phloem.runtime.tokenizer.tokenizer import load_tokenizer
    from phloem.training.eagle_head import encode_prompts

    torch.set_num_threads(1)
    source = resolve_model(None)
    runner = ModelRunner(source, dtype="float32", device="cpu", max_total_tokens=4096, max_running_requests=8)
    tok = load_tokenizer(source)
    prompts = encode_prompts(["List three colors of the rainbow.", "Write the numbers from 1 to 12."], tok)
    b = DirectBatcher(runner)
    refs = [b.generate_greedy(p, 24) for p in prompts]
    return runner, prompts, refs


@pytest.mark.parametrize("num_steps, topk, num_draft_tokens", [(3, 1, 4), (4, 4, 8)])
def test_eagle_greedy_matches_plain(setup, num_steps, topk, num_draft_tokens):
    from phloem.runtime.speculative import DEFAULT_EAGLE_HEAD
    from phloem.runtime.speculative.decoding import EagleDrafter, SpeculativeDecoder
    from phloem.runtime.speculative.eagle import EagleDraftWorker, load_eagle_head

    runner, prompts, refs = setup
    worker = EagleDraftWorker.for_runner(load_eagle_head(DEFAULT_EAGLE_HEAD), runner, num_steps=num_steps,
                                         topk=topk, num_draft_tokens=num_draft_tokens)  # fmt: skip
    outs = SpeculativeDecoder(runner, EagleDrafter(worker)).generate(prompts, 24)
    assert [o.tokens for o in outs] == refs
    assert sum(sum(o.accept_lengths) for o in outs) / sum(len(o.accept_lengths) for o in outs) > 1.0


def test_ngram_greedy_matches_plain(setup):
    from phloem.runtime.speculative.decoding import NgramDrafter, SpeculativeDecoder
    from phloem.runtime.speculative.ngram import NgramProposer

    runner, prompts, refs = setup
    outs = SpeculativeDecoder(runner, NgramDrafter(NgramProposer(4))).generate(prompts, 24)
    assert [o.tokens for o in outs] == refs
