"""The KV pool path gives the same logits however a sequence is split into passes and batches.

Runs on small random-weight models (fast) and on the default GGUF model.
"""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.forward_io import LogprobRequest
from phloem.runtime.model_files import ModelSource, resolve_model

ATOL = 2e-4


def _sampler():
    try:
        from phloem.runtime.sampling.sampler import Sampler

        return Sampler()
    except ImportError:
        return lambda logits, info: logits.argmax(-1)


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


_RUNNERS: dict[str, ModelRunner] = {}


def runner_for(name: str) -> ModelRunner:
    if name not in _RUNNERS:
        source = resolve_model(None) if name == "gguf" else ModelSource("dummy", name)
        _RUNNERS[name] = ModelRunner(source, dtype="float32", device="cpu", max_total_tokens=4096,
                                     max_running_requests=16, sampler=_sampler(), cpu_threads=1)  # fmt: skip
    return _RUNNERS[name]


MODELS = ["tiny-llama", "tiny-qwen3", "gguf"]


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 5000), (n,), generator=gen).tolist()


@pytest.fixture(params=MODELS)
def batcher(request) -> DirectBatcher:
    runner = runner_for(request.param)
    b = DirectBatcher(runner)
    yield b
    for seq in list(b.tokens):
        b.release(seq)


@pytest.mark.parametrize("split", [1, 9, 23])
def test_prefix_plus_extend_equals_full_prefill(batcher: DirectBatcher, split: int) -> None:
    ids = prompt(24, 0, batcher.runner.vocab_size)
    full, parts = batcher.new_sequence(), batcher.new_sequence()
    expect = batcher.logits({full: ids})
    batcher.logits({parts: ids[:split]})
    got = batcher.logits({parts: ids[split:]})
    torch.testing.assert_close(got, expect, atol=ATOL, rtol=0)


def test_decode_equals_extend_of_one_token(batcher: DirectBatcher) -> None:
    ids = prompt(12, 1, batcher.runner.vocab_size)
    a, b = batcher.new_sequence(), batcher.new_sequence()
    batcher.logits({a: ids[:-1], b: ids[:-1]})
    via_decode = batcher.logits({a: ids[-1:]}, decode=True)
    via_extend = batcher.logits({b: ids[-1:]})
    torch.testing.assert_close(via_decode, via_extend, atol=ATOL, rtol=0)
    # a batched decode of several sequences equals each alone
    c = batcher.new_sequence()
    batcher.logits({c: ids[:5]})
    both = batcher.logits({a: [7], c: [9]}, decode=True)
    b_alone = batcher.logits({b: [7]}, decode=True)
    torch.testing.assert_close(both[0:1], b_alone, atol=ATOL, rtol=0)


def test_batched_mixed_extend_equals_each_alone(batcher: DirectBatcher) -> None:
    vocab = batcher.runner.vocab_size
    cases = [
        ([], prompt(17, 2, vocab)),
        (prompt(6, 3, vocab), prompt(1, 4, vocab)),
        (prompt(3, 5, vocab), prompt(9, 6, vocab)),
    ]
    alone, batched = [], {}
    for prefix, new in cases:
        s = batcher.new_sequence()
        if prefix:
            batcher.logits({s: prefix})
        alone.append(batcher.logits({s: new}))
        t = batcher.new_sequence()
        if prefix:
            batcher.logits({t: prefix})
        batched[t] = new
    got = batcher.logits(batched)
    torch.testing.assert_close(got, torch.cat(alone), atol=ATOL, rtol=0)


def test_logprobs_match_full_logits() -> None:
    runner = runner_for("tiny-llama")
    b = DirectBatcher(runner)
    ids = prompt(10, 7, runner.vocab_size)
    # reference: log_softmax after each prefix, one sequence per prefix length
    ref = []
    for n in range(1, len(ids) + 1):
        s = b.new_sequence()
        ref.append(torch.log_softmax(b.logits({s: ids[:n]}), -1)[0])
        b.release(s)
    s, other = b.new_sequence(), b.new_sequence()
    b.logits({s: ids[:4]})  # cached prefix of 4
    req = LogprobRequest(
        return_logprob=torch.tensor([True, False]), top_logprobs_nums=[3, 0],
        token_ids_logprob=[[5, 6], None], input_logprob_starts=[0, -1],
    )  # fmt: skip
    out = runner.forward(b.build({s: ids[4:], other: ids[:3]}, logprobs=req))
    token = out.synchronize()[0]
    lp = out.logprobs[0]
    last = ref[-1]
    assert token == int(last.argmax())
    assert lp.output_logprob == pytest.approx(float(last[token]), abs=1e-5)
    assert [t for t, _ in lp.output_top] == last.topk(3).indices.tolist()
    assert lp.output_token_ids[1][0] == 6 and lp.output_token_ids[1][1] == pytest.approx(
        float(last[6]), abs=1e-5
    )
    # new tokens are ids[4:]; new token 0 has no row in this pass, token j>0 reads ref[4 + j - 1]
    assert lp.input_logprobs[0] is None and len(lp.input_logprobs) == len(ids) - 4
    for j in range(1, len(ids) - 4):
        assert lp.input_logprobs[j] == pytest.approx(float(ref[3 + j][ids[4 + j]]), abs=1e-5)
        assert [t for t, _ in lp.input_top[j]] == ref[3 + j].topk(3).indices.tolist()
    assert out.logprobs[1].output_logprob is None and out.logprobs[1].input_logprobs is None


def test_runner_info() -> None:
    runner = runner_for("tiny-llama")
    assert runner.vocab_size == 512 and runner.context_len == 1024
    assert runner.max_total_num_tokens == 4096 and runner.kv_pool.num_slots == 4097
    assert runner.req_to_token_pool.req_to_token.shape == (16, 1024)


HF_TINY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "llama-scaled": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(HF_TINY))
def test_tiny_hf_checkpoint_matches_transformers(tmp_path, name: str) -> None:
    """Random tiny HF checkpoints (safetensors) load and give transformers' logits."""
    import transformers

    cfg_cls, model_cls, extra = HF_TINY[name]
    cfg = getattr(transformers, cfg_cls)(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rope_theta=5000.0,
        **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(cfg).eval()
    if name == "qwen2":  # random biases so the bias path is exercised
        with torch.no_grad():
            for layer in hf.model.layers:
                layer.self_attn.q_proj.bias.normal_()
                layer.self_attn.k_proj.bias.normal_()
    hf.save_pretrained(tmp_path)
    runner = ModelRunner(resolve_model(str(tmp_path)), dtype="float32", device="cpu", max_total_tokens=512,
                         max_running_requests=2, sampler=_sampler(), cpu_threads=1)  # fmt: skip
    assert runner.model_config.arch == name.split("-")[0] and runner.model_config.rope_theta == 5000.0
    assert (runner.model_config.rope_scaling is not None) == (name == "llama-scaled")
    ids = prompt(40, 8, 300)
    b = DirectBatcher(runner)
    seq = b.new_sequence()
    b.logits({seq: ids[:30]})
    got = b.logits({seq: ids[30:]})
    with torch.inference_mode():
        expect = hf(torch.tensor([ids])).logits[0, -1:].float()
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
