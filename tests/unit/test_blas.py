"""``--gemm-library``: which library torch's matmuls use on CUDA (``runtime/layers/blas.py``)."""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.layers.blas import LT_MIN_HIDDEN, apply_gemm_library, resolve_gemm_library


@pytest.mark.parametrize(
    ("choice", "hidden", "device", "expected"),
    [
        ("auto", LT_MIN_HIDDEN, "cuda", "cublaslt"),  # Llama-3-8B's width: measured faster
        ("auto", 5120, "cuda", "cublaslt"),
        ("auto", LT_MIN_HIDDEN - 1, "cuda", None),  # narrower models keep torch's choice
        ("auto", 576, "cuda", None),
        ("cublas", 4096, "cuda", "cublas"),  # an explicit choice holds at any width
        ("cublaslt", 576, "cuda", "cublaslt"),
        ("auto", 4096, "cpu", None),  # nothing to choose off CUDA
        ("cublaslt", 4096, "cpu", None),
    ],
)
def test_resolve(choice: str, hidden: int, device: str, expected: str | None) -> None:
    assert resolve_gemm_library(choice, hidden, device) == expected


def test_unknown_choice_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--gemm-library rocblas: expected one of auto, cublas, cublaslt"):
        resolve_gemm_library("rocblas", 4096, "cuda")


def test_apply_on_cpu_changes_nothing() -> None:
    before = torch.backends.cuda.preferred_blas_library()
    assert apply_gemm_library("cublaslt", 4096, torch.device("cpu")) == "cpu"
    assert torch.backends.cuda.preferred_blas_library() == before
