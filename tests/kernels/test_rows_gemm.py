"""The rows matmul kernel (17-256 rows) against ``F.linear``.

- CUDA: Llama-3-8B's projections and ragged shapes at 17-256 rows, both 16-bit dtypes, fresh
  inputs per seed, with the default settings and with one and several key splits.
- CPU: the small cases under Triton's interpreter (a child process, ``rows_gemm_cases.py``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from .interpreter import assert_interpreted_cases_pass
from .rows_gemm_cases import (
    DTYPES,
    ROWS,
    SHAPES,
    SMALL_ROWS,
    SMALL_SHAPES,
    check_rejects,
    check_row_chunks,
    check_rows,
)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
has_triton = importlib.util.find_spec("triton") is not None


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rows_matches_linear(shape: tuple[int, int], rows: int, dtype: str) -> None:
    from phloem.runtime.layers.rows_gemm import RowsConfig

    for seed, config in ((0, None), (1, RowsConfig(64, 64, 1, 4, 4)), (2, RowsConfig(128, 64, 5, 8, 3))):
        check_rows(shape, rows, DTYPES[dtype], "cuda", seed, config)


@pytest.mark.gpu
@requires_cuda
def test_rows_rejects_bad_calls_cuda() -> None:
    check_rejects("cuda")


@pytest.mark.skipif(not has_triton, reason="triton is not installed")
def test_row_chunks() -> None:
    check_row_chunks()


@pytest.mark.skipif(not has_triton, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the compiled kernel is tested instead")
def test_rows_under_interpreter() -> None:
    assert_interpreted_cases_pass(
        "tests.kernels.rows_gemm_cases", len(SMALL_SHAPES) * len(SMALL_ROWS) * 2 * 2 + 2
    )
