"""The Triton attention kernels on the CPU, under Triton's interpreter, against ``torch_ref``.

The interpreter must be switched on before ``triton`` is imported, so the cases run in a child
process (``interpret_attention.py``); small shapes keep it to seconds.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from .attention_cases import interpreted_cases
from .interpreter import assert_interpreted_cases_pass


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CUDA present: test_attention_triton.py checks the compiled kernels instead "
    "(the interpreter of triton 3.6 with numpy 2.5 also fails on scalar loads used as loop bounds)",
)
def test_triton_kernels_under_interpreter() -> None:
    assert_interpreted_cases_pass("tests.kernels.interpret_attention", interpreted_cases(False), shards=2)
