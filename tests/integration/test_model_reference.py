"""The default GGUF model through ModelRunner vs transformers loading the same file (float32).

Checks log-softmax agreement on a 64-token prompt (every position) and identical greedy
32-token continuations, decoded step by step through the KV pool. The ``int4`` path (the GGUF's
own Q4_1 blocks) computes with the same weights, so its logits stay within float32 rounding.
"""

from __future__ import annotations

import os

import pytest
import torch
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.forward_io import LogprobRequest
from phloem.runtime.model_files import resolve_model
from phloem.runtime.tokenizer.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # one_thread: tests/conftest.py

PLAIN = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. Within "
    "fifty years presses were running in more than two hundred European cities, and the price of a "
    "book fell so quickly that scholars, merchants and even some craftsmen could afford to own small "
    "libraries of their own. The consequences were"
)
CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(resolve_model(None).path)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    try:
        from phloem.runtime.sampling.sampler import Sampler

        sampler = Sampler()
    except ImportError:
        sampler = lambda logits, info: logits.argmax(-1)  # noqa: E731
    return ModelRunner(resolve_model(None), dtype="float32", device="cpu", max_total_tokens=2048,
                       max_running_requests=4, sampler=sampler, cpu_threads=1)  # fmt: skip


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = resolve_model(None).path
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


def test_logprobs_match_transformers(runner: ModelRunner, hf_model, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PLAIN)[:64]
    assert len(ids) == 64
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)  # [64, V]
    b = DirectBatcher(runner)
    seq = b.new_sequence()
    req = LogprobRequest(return_logprob=torch.tensor([True]), top_logprobs_nums=[5],
                         token_ids_logprob=[None], input_logprob_starts=[1])  # fmt: skip
    fi = b.build({seq: ids}, logprobs=req)
    ours_last = torch.log_softmax(runner.forward_logits(fi)[0], -1)
    assert (ours_last - ref[-1]).abs().max().item() < 1e-3
    # every position: the input logprob of token j comes from the row after token j - 1
    b.release(seq)
    seq = b.new_sequence()
    out = runner.forward(b.build({seq: ids}, logprobs=req)).logprobs[0]
    expect = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor(out.input_logprobs)
    assert got.shape == expect.shape
    assert (got - expect).abs().max().item() < 1e-3
    top_ref = ref[-1].topk(5)
    assert [t for t, _ in out.output_top] == top_ref.indices.tolist()
    b.release(seq)


@pytest.mark.parametrize("case", ["plain", "chat0", "chat1"])
def test_greedy_continuations_match_transformers(
    case: str, runner: ModelRunner, hf_model, tokenizer: Tokenizer
) -> None:
    text = PLAIN if case == "plain" else tokenizer.apply_chat_template(CHATS[int(case[-1])])
    ids = tokenizer.encode(text)
    eos = tokenizer.eos_token_id
    with torch.inference_mode():
        hf_out = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                   eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()  # fmt: skip
    ours = DirectBatcher(runner).generate_greedy(ids, 32, stop_ids={eos})
    assert ours == hf_out, (tokenizer.decode(ours), tokenizer.decode(hf_out))


def test_int4_runner_matches_float(runner: ModelRunner, tokenizer: Tokenizer) -> None:
    """Same weights (Q4_1 blocks as stored), another summation order: near-equal logits, same text."""
    quant = ModelRunner(resolve_model(None), dtype="float32", device="cpu", max_total_tokens=2048,
                        max_running_requests=4, sampler=lambda logits, info: logits.argmax(-1),
                        quantization="int4", cpu_threads=1)  # fmt: skip
    ids = tokenizer.encode(tokenizer.apply_chat_template(CHATS[0]))
    ref_b, q_b = DirectBatcher(runner), DirectBatcher(quant)
    s_ref, s_q = ref_b.new_sequence(), q_b.new_sequence()
    torch.testing.assert_close(q_b.logits({s_q: ids}), ref_b.logits({s_ref: ids}), atol=2e-3, rtol=0)
    text = tokenizer.decode(DirectBatcher(quant).generate_greedy(ids, 16, stop_ids={tokenizer.eos_token_id}))
    assert "Paris" in text, text
