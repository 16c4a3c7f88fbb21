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


def test_serve_on_a_taken_port_fails_before_loading_with_one_line():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run(
            [sys.executable, "-m", "phloem", "serve", "--port", str(port), "--log-level", "warning"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert res.returncode == 2
    assert f"--port {port}: cannot listen" in res.stderr
    assert "Traceback" not in res.stderr and "model runner ready" not in res.stderr


def test_cuda_on_a_machine_without_one_is_one_line():
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal cannot be seen")
    res = subprocess.run(
        [sys.executable, "-m", "phloem", "serve", "--device", "cuda", "--port", "0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "phloem: error: --device cuda: no CUDA device is visible to this torch build; use --device cpu (or auto)"
    ]


def test_generate_with_a_model_id_from_the_local_hub_cache(tmp_path):
    """``--model-path org/name`` on the default model, found in an ``HF_HUB_CACHE`` snapshot."""
    import os

    from tests.unit.test_hub_ids import fake_cache

    fake_cache(tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct")
    res = subprocess.run(
        [sys.executable, "-m", "phloem", "generate", "--model-path", "HuggingFaceTB/SmolLM2-135M-Instruct",
         "--prompt", "The capital of France is", "--max-new-tokens", "8", "--temperature", "0"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_CACHE": str(tmp_path)},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def test_a_model_id_that_is_not_cached_is_one_line(tmp_path):
    import os

    res = subprocess.run(
        [sys.executable, "-m", "phloem", "generate", "--model-path", "org/absent", "--prompt", "x"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_CACHE": str(tmp_path)},
    )  # fmt: skip
    assert res.returncode == 2
    (line,) = res.stderr.strip().splitlines()
    assert "org/absent" in line and "does not download" in line


def test_start_up_log_names_the_model_its_load_time_and_the_kv_pool_size():
    code = (
        "from phloem import Engine\n"
        "if __name__ == '__main__':\n"
        "    with Engine(log_level='info') as e:\n"
        "        pass\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    from phloem.runtime.model_files import default_model_path

    assert "model runner ready in " in res.stderr and f"model={default_model_path()} (gguf)" in res.stderr
    assert "GiB), chunked_prefill_size" in res.stderr and "available_mem=n/a on the CPU" in res.stderr
