"""The Triton tree-verify kernel against its plain-torch oracle: on the GPU over every case, and
on the CPU under Triton's interpreter over the small ones (in a child process)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.kernels.verify_cases import CASES, HEADS

from .interpreter import run_interpreted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("case", list(CASES))
def test_tree_verify_matches_reference_on_gpu(case, heads, dtype):
    from tests.kernels.verify_cases import compare

    for seed in range(3):  # fresh random inputs each time
        compare(case, heads, dtype, "cuda", seed=seed)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the compiled kernel is checked instead")
def test_tree_verify_under_interpreter():
    proc = run_interpreted("tests.kernels.interpret_tree_verify")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 8, proc.stdout
