"""The draft head's attention over its cache (``runtime/speculative/draft_attention.py``).

- CPU: the reference against a per-query loop of plain softmax attention; the kernel path under
  Triton's interpreter (a child process, ``draft_attention_cases.py``).
- CUDA: the compiled kernel against the reference at the head shapes of SmolLM2 and Llama-3-8B.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from .draft_attention_cases import SHAPES, SMALL_SHAPES, check_draft_attention
from .interpreter import assert_interpreted_cases_pass

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_reference_is_masked_softmax_attention_per_query() -> None:
    from phloem.runtime.speculative.draft_attention import attend_reference

    gen = torch.Generator().manual_seed(0)
    r, n, hq, hk, d = 3, 12, 6, 2, 8
    k, v = torch.randn((2, r, n, hk, d), generator=gen)
    rows = torch.tensor([2, 0])
    limits = torch.tensor([[1, 5, 12], [7, 8, 3]])
    q = torch.randn((2, 3, hq, d), generator=gen)
    out = attend_reference(q, k, v, rows, limits, max_keys=n)
    for b in range(2):
        for i in range(3):
            for h in range(hq):
                keys = k[rows[b], : limits[b, i], h // (hq // hk)]  # [lim, D]
                p = torch.softmax(keys @ q[b, i, h] / d**0.5, dim=0)
                assert torch.allclose(
                    out[b, i, h], p @ v[rows[b], : limits[b, i], h // (hq // hk)], atol=1e-5
                )
    # a smaller max_keys that still covers every limit changes nothing
    assert torch.allclose(attend_reference(q, k, v, rows, limits.clamp(max=9), 9),
                          attend_reference(q, k, v, rows, limits.clamp(max=9), n), atol=1e-6)  # fmt: skip


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"m{s[0]}_b{len(s[1])}_d{s[6]}")
def test_kernel_matches_reference(shape, dtype: str) -> None:  # type: ignore[no-untyped-def]
    for seed in (0, 1):
        check_draft_attention(shape, getattr(torch, dtype), "cuda", seed)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the compiled kernel is tested instead")
def test_kernel_under_interpreter() -> None:
    assert_interpreted_cases_pass("tests.kernels.draft_attention_cases", 2 * len(SMALL_SHAPES), shards=2)
