"""Mask application: the torch reference against a naive loop, and Triton against the reference."""

from __future__ import annotations

import pytest
import torch
from phloem.grammars.bitmask import (
    allocate_bitmask,
    apply_bitmask,
    apply_bitmask_ref,
    apply_bitmask_triton,
    bitmask_words,
    unpack_bitmask,
)

# (batch, vocab of the mask, width of the logits)
SHAPES = [(1, 32, 32), (3, 100, 100), (2, 49152, 49152), (2, 49152, 49216), (4, 1000, 1031), (1, 33, 64)]


def _naive(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for b in range(out.shape[0]):
        for t in range(out.shape[1]):
            w, j = divmod(t, 32)
            if not (w < bitmask.shape[1] and (int(bitmask[b, w]) >> j) & 1):
                out[b, t] = float("-inf")
    return out


def _random_case(batch: int, vocab: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, width, generator=gen)
    mask = torch.randint(-(2**31), 2**31 - 1, (batch, bitmask_words(vocab)), generator=gen, dtype=torch.int64)
    return logits, mask.to(torch.int32)


@pytest.mark.parametrize("batch,vocab,width", [s for s in SHAPES if s[2] <= 2000])
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_naive_loop(batch, vocab, width, seed):
    logits, mask = _random_case(batch, vocab, width, seed)
    expected = _naive(logits, mask)
    assert torch.equal(apply_bitmask_ref(logits.clone(), mask), expected)
    assert torch.equal(apply_bitmask(logits.clone(), mask), expected)


def test_unpack_and_allocate():
    mask = allocate_bitmask(2, 70)
    assert mask.shape == (2, 3) and mask.dtype == torch.int32
    mask[1, 2] = 0
    mask[1, 0] = 1 << 5
    allowed = unpack_bitmask(mask, 70)
    assert allowed[0].all()
    assert allowed[1].nonzero().flatten().tolist() == [5, *range(32, 64)]


def test_sign_bit_is_token_31():
    mask = torch.tensor([[-(2**31)]], dtype=torch.int32)
    logits = apply_bitmask_ref(torch.zeros(1, 32), mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [31]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch,vocab,width", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(batch, vocab, width, dtype):
    logits, mask = _random_case(batch, vocab, width, seed=batch + width)
    logits = logits.to("cuda", dtype)
    expected = apply_bitmask_ref(logits.clone(), mask.cuda())
    assert torch.equal(apply_bitmask_triton(logits.clone(), mask.cuda()), expected)
    assert torch.equal(apply_bitmask(logits.clone(), mask), expected)
