"""The greedy step under device automata against the torch path (``automaton_cases.py``): compiled
kernels on CUDA at SmolLM2 and Llama-3 vocabularies, Triton's interpreter on the CPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from .automaton_cases import SHAPES, SMALL_SHAPES, check_step
from .interpreter import assert_interpreted_cases_pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_automaton_step_matches_torch(shape: tuple[int, int, int], dtype: str) -> None:
    for seed in (0, 1):
        check_step(shape, getattr(torch, dtype), "cuda", seed)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the compiled kernels are tested instead")
def test_automaton_step_under_interpreter() -> None:
    assert_interpreted_cases_pass("tests.kernels.automaton_cases", 2 * len(SMALL_SHAPES))
