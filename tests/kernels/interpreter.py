"""Run a kernel-check module under Triton's CPU interpreter, in a child process: the switch must
be set before Triton is imported, and the parent has imported it already."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m module *args`` with ``TRITON_INTERPRET=1`` and no visible GPU, from the repository root."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
