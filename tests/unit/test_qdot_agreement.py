"""Greedy agreement of the default CPU path (``gguf``: int8 activations on the file's blocks) with
exact float32 (``none``) on the default model, over a table of 20 prompts x 32 tokens.

Both runners decode teacher-forced along float32's own greedy continuation, so every position
compares the two paths' top-1 token after the same context (free-running decodes would diverge at
the first near-tie and compare unrelated text afterwards). Measured on this model (AVX-512
VNNI, one thread): 627 of the 640 positions agree (98.0%), no prompt loses more than 2 of its 32,
and 8 of the 20 free-running continuations are identical for all 32 tokens.

The floors sit a few disagreements below those numbers, to leave room for another machine's
float32 reference (MKL picks kernels by CPU), not for a worse kernel: the integer part of every
kernel variant is exact (``test_qdot.py``), so a drop below them means the computation changed.
Run with ``-s`` to print the table.
"""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.model_files import resolve_model

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "Write a haiku about autumn leaves.",
    "List three primary colors:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The speed of light in vacuum is",
    "Translate to French: Good morning, how are you?",
    "Explain photosynthesis in one sentence.",
    "1, 2, 3, 4, 5,",
    "The best way to learn a new language is",
    "import numpy as np\nx = np.",
    "Q: What is the boiling point of water?\nA:",
    "My favorite animal is the",
    "Here is a recipe for pancakes:",
    "The three laws of motion are",
    "SELECT name FROM users WHERE",
    "Dear hiring manager,",
    "The weather today is",
    "In 1969, the first humans",
    "A good password should",
]
TOKENS = 32
MIN_TOP1_AGREEMENT = 0.95  # teacher-forced positions (measured 0.980)
MIN_IDENTICAL_CONTINUATIONS = 6  # of 20 free-running (measured 8)


def _runner(quantization: str) -> ModelRunner:
    return ModelRunner(resolve_model(None), dtype="float32", device="cpu", max_total_tokens=4096,
                       max_running_requests=len(PROMPTS), quantization=quantization)  # fmt: skip


def _greedy(
    b: DirectBatcher, prompts: list[list[int]], forced: list[list[int]] | None = None
) -> list[list[int]]:
    """Top-1 token after each prompt and after each next token, all prompts in one batch: the
    tokens fed back are each row's own choices, or ``forced``'s (teacher forcing)."""
    seqs = [b.new_sequence() for _ in prompts]
    try:
        tops = [[t] for t in b.logits(dict(zip(seqs, prompts))).argmax(-1).tolist()]
        for j in range(TOKENS - 1):
            fed = [row[j] for row in (forced if forced is not None else tops)]
            step = b.logits({s: [tok] for s, tok in zip(seqs, fed)}, decode=True).argmax(-1).tolist()
            for row, t in zip(tops, step):
                row.append(t)
        return tops
    finally:
        for s in seqs:
            b.release(s)


def test_gguf_path_agrees_with_float32_greedy() -> None:
    from phloem.runtime.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    float_b, quant_b = DirectBatcher(_runner("none")), DirectBatcher(_runner("gguf"))
    assert quant_b.runner.quantization == "gguf"
    prompts = [tok.encode(text) for text in PROMPTS]
    with torch.no_grad():
        ref = _greedy(float_b, prompts)
        forced = _greedy(quant_b, prompts, forced=ref)
        free = _greedy(quant_b, prompts)
    agree = total = identical = 0
    for text, r, f, g in zip(PROMPTS, ref, forced, free):
        same = sum(a == b for a, b in zip(r, f))
        identical += g == r
        agree, total = agree + same, total + len(r)
        print(f"{same:2d}/{len(r)} forced, free run identical: {g == r}  {text!r}")
    print(f"top-1 agreement {agree}/{total} = {agree / total:.3f}; identical continuations {identical}/20")
    assert agree / total >= MIN_TOP1_AGREEMENT
    assert identical >= MIN_IDENTICAL_CONTINUATIONS
