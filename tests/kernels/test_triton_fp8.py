"""Triton paged attention over an fp8 KV pool against the ``torch_ref`` oracle.

The oracle attends over the dequantized pool (``attention_cases.compare_with_ref``), so the
tolerance is the compute dtype's: these tests check that the kernels load fp8 and apply the
per-tensor scales, not how much fp8 rounding costs (``tests/unit/test_kv_fp8.py`` measures that).
On the CPU the small cases run under Triton's interpreter in a child process; on CUDA the full
tables run compiled.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from .attention_cases import (
    BATCHES,
    DTYPES,
    HEADS,
    check_decode_new_kv,
    compare_with_ref,
    interpreted_cases,
    make_batch,
)
from .interpreter import assert_interpreted_cases_pass

FP8 = torch.float8_e4m3fn
SCALES = {"scale1": (1.0, 1.0), "scaled": (0.05, 0.02)}
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (CPU: the interpreter test)"
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the compiled tests below run instead")
def test_triton_fp8_kernels_under_interpreter() -> None:
    assert_interpreted_cases_pass("tests.kernels.interpret_attention", interpreted_cases(True), "--fp8", shards=2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scales", sorted(SCALES))
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("heads", ["gqa3_d64", "gqa4_d128"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_triton_fp8_matches_torch_ref(batch: str, heads: str, dtype: str, scales: str) -> None:
    prefix_lens, extend_lens, mode = BATCHES[batch]
    h = HEADS[heads]
    b = make_batch(
        prefix_lens, extend_lens, mode, h, dtype=DTYPES[dtype], device="cuda", seed=0,
        kv_dtype=FP8, kv_scales=SCALES[scales],
    )  # fmt: skip
    compare_with_ref("triton", b, h.q)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("scales", sorted(SCALES))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("heads", ["gqa3_d64", "gqa4_d128"])
def test_triton_fp8_decode_stores_the_new_token(heads: str, dtype: str, scales: str, qk_norm: bool) -> None:
    """The decode kernel quantizes the new K/V into the fp8 pool as ``rope_store_`` does, and
    attends to the quantized values (through the backend, with RoPE tables)."""
    check_decode_new_kv(
        [0, 63, 64, 127, 128, 17, 300, 1000], HEADS[heads], dtype=DTYPES[dtype], device="cuda", seed=5,
        qk_norm=qk_norm, kv_dtype=FP8, kv_scales=SCALES[scales], via_backend=True,
    )  # fmt: skip
