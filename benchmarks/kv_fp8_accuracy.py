"""What an fp8 KV cache costs in accuracy on the default model (``--kv-cache-dtype fp8_e4m3``).

    python -m phloem.bench.kv_fp8_accuracy --max-new-tokens 32

Two ``ModelRunner``s on the CPU, float32 compute, identical but for the KV pool (``auto`` = float32
and ``fp8_e4m3``), greedy over chat-templated prompts (no scheduler, one thread). Reports:

- greedy agreement: first token, tokens before the first divergence, identical continuations;
- teacher forced over ``prompt + the auto runner's continuation`` (both score the same text): the
  mean |difference| of each actual next token's logprob and how often the top-1 tokens agree.

The engine-level check with the same prompts is ``tests/integration/test_kv_fp8.py``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "Explain photosynthesis to a ten-year-old.",
    "List three uses of a paperclip.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a short poem about the sea.",
    "What are the main differences between a cat and a dog as pets?",
]


def _runner(kv_cache_dtype: str) -> Any:
    from phloem.runtime.executor.model_runner import ModelRunner
    from phloem.runtime.model_files import resolve_model

    return ModelRunner(resolve_model(None), dtype="float32", device="cpu", max_total_tokens=8192,
                       max_running_requests=2, sampler=lambda logits, info: logits.argmax(-1),
                       cpu_threads=1, kv_cache_dtype=kv_cache_dtype)  # fmt: skip


def _scored(runner: Any, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Logprob of each token after the first given the ones before it, and the top-1 token there."""
    from phloem.runtime.executor.model_runner import DirectBatcher
    from phloem.runtime.forward_io import LogprobRequest

    b = DirectBatcher(runner)
    seq = b.new_sequence()
    req = LogprobRequest(return_logprob=torch.tensor([True]), top_logprobs_nums=[1],
                         token_ids_logprob=[None], input_logprob_starts=[1])  # fmt: skip
    out = runner.forward(b.build({seq: ids}, logprobs=req)).logprobs[0]
    b.release(seq)
    return torch.tensor(out.input_logprobs), [top[0][0] for top in out.input_top]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    from phloem.runtime.executor.model_runner import DirectBatcher
    from phloem.runtime.model_files import resolve_model
    from phloem.runtime.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(resolve_model(None).path)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    auto, fp8 = _runner("auto"), _runner("fp8_e4m3")
    stop = {tok.eos_token_id}
    diffs, agree, positions, before_divergence, generated, identical, first_same = [], 0, 0, 0, 0, 0, 0
    for i, prompt in enumerate(prompts):
        a = DirectBatcher(auto).generate_greedy(prompt, args.max_new_tokens, stop_ids=stop)
        f = DirectBatcher(fp8).generate_greedy(prompt, args.max_new_tokens, stop_ids=stop)
        (lp_a, top_a), (lp_f, top_f) = _scored(auto, prompt + a), _scored(fp8, prompt + a)
        diffs.append((lp_a - lp_f).abs())
        agree += sum(x == y for x, y in zip(top_a, top_f))
        positions += len(top_a)
        n = _common_prefix(a, f)
        before_divergence, generated = before_divergence + n, generated + len(a)
        identical, first_same = identical + (a == f), first_same + (a[0] == f[0])
        print(f"prompt {i}: {len(prompt)} tokens, greedy tokens before divergence {n}/{len(a)}")
    d = torch.cat(diffs)
    print(
        f"{len(prompts)} prompts x {args.max_new_tokens} greedy tokens: first token same {first_same}/{len(prompts)}, "
        f"identical continuations {identical}/{len(prompts)}, tokens before first divergence "
        f"{before_divergence}/{generated} ({before_divergence / generated:.0%})\n"
        f"teacher forced ({positions} positions): mean |dlogprob| {d.mean():.4f}, median {d.median():.4f}, "
        f"max {d.max():.4f}; top-1 agreement {agree}/{positions} ({agree / positions:.1%})"
    )


if __name__ == "__main__":
    main()
