"""The Triton attention kernels on the CPU, under Triton's interpreter, against ``torch_ref``.

The interpreter must be switched on before ``triton`` is imported, so the cases run in a child
process (``interpret_attention.py``); small shapes keep it to seconds.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CUDA present: test_attention_triton.py checks the compiled kernels instead "
    "(the interpreter of triton 3.6 with numpy 2.5 also fails on scalar loads used as loop bounds)",
)
def test_triton_kernels_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.interpret_attention"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
