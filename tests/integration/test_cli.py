"""The command line on the default model."""

from __future__ import annotations

import subprocess
import sys


def test_generate_names_paris():
    res = subprocess.run(
        [sys.executable, "-m", "phloem", "generate", "--prompt", "The capital of France is",
         "--max-new-tokens", "8", "--temperature", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def test_missing_model_path_is_a_clear_error():
    res = subprocess.run(
        [sys.executable, "-m", "phloem", "generate", "--prompt", "x", "--model-path", "/nonexistent/model.gguf"],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode != 0
    assert "/nonexistent/model.gguf" in res.stderr
