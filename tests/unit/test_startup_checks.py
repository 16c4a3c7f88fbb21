"""Start-up refuses what it cannot honour with one line naming the option, before any model loads:
a memory fraction outside (0, 1], a watchdog timeout that is not positive, ``--device cuda``
without a visible GPU, a port it cannot bind."""

from __future__ import annotations

import socket

import pytest
import torch
from phloem.runtime.config import EngineArgs
from phloem.runtime.launch import check_supported
from phloem.runtime.server.app import check_port_free


@pytest.mark.parametrize("fraction", [1.5, 0.0, -0.2])
def test_memory_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(ValueError, match=r"--mem-fraction-static .*\(0, 1\]"):
        check_supported(EngineArgs(mem_fraction_static=fraction))


def test_a_fraction_inside_is_accepted():
    check_supported(EngineArgs(mem_fraction_static=0.8))
    check_supported(EngineArgs(mem_fraction_static=1.0))


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan")])
def test_a_watchdog_timeout_that_is_not_positive_is_refused(seconds):
    with pytest.raises(ValueError, match="--watchdog-timeout must be > 0"):
        check_supported(EngineArgs(watchdog_timeout=seconds))


def test_cuda_without_a_gpu_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda: no CUDA device"):
        check_supported(EngineArgs(device="cuda"))
    check_supported(EngineArgs(device="auto"))  # auto falls back to the CPU


def test_a_port_in_use_is_refused_naming_the_flag():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"--port {port}: cannot listen on 127.0.0.1:{port}"):
            check_port_free("127.0.0.1", port)


def test_a_free_port_and_port_zero_pass():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", 0)
