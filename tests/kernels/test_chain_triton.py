"""A chain step's layout kernel against its torch reference (``chain_cases.py``): compiled on
CUDA at the SmolLM2 and Llama-3 vocabularies, Triton's interpreter on the CPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from .chain_cases import SHAPES, SMALL_SHAPES, check_layout
from .interpreter import assert_interpreted_cases_pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_chain_layout_matches_torch(shape: tuple[int, int, int, int]) -> None:
    for seed in (0, 1):
        check_layout(shape, "cuda", seed)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the compiled kernel is tested instead")
def test_chain_layout_under_interpreter() -> None:
    assert_interpreted_cases_pass("tests.kernels.chain_cases", len(SMALL_SHAPES))
