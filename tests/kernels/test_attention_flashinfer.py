"""FlashInfer paged attention against the ``torch_ref`` oracle (skipped where FlashInfer is absent)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from .attention_cases import BATCHES, DTYPES, HEADS, compare_with_ref, make_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is None,
        reason="flashinfer is not installed (an optional backend)",
    ),
]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])  # FlashInfer has no fp32 kernels
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_flashinfer_matches_torch_ref(batch: str, heads: str, dtype: str) -> None:
    prefix_lens, extend_lens, mode = BATCHES[batch]
    h = HEADS[heads]
    b = make_batch(prefix_lens, extend_lens, mode, h, dtype=DTYPES[dtype], device="cuda", seed=0)
    compare_with_ref("flashinfer", b, h.q)
