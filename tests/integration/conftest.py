"""Shared engines for integration tests on the real default model (CPU)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def engine():
    from phloem import Engine

    eng = Engine(log_level="warning")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def float_engine():
    """An engine on exact float32 weights (``quantization="none"``): for tests that read or write
    projection weights, or compare against a float32 forward. The default engine computes on the
    GGUF's quantized blocks, whose float weights do not exist."""
    from phloem import Engine

    eng = Engine(quantization="none", log_level="warning")
    yield eng
    eng.shutdown()


def pool_is_idle(info: dict) -> bool:
    live = info["live"]
    return live["available_tokens"] == live["max_total_num_tokens"] and live["num_running_reqs"] == 0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m phloem serve`` on a free loopback port, for tests that speak real HTTP."""

    def __init__(self, *flags: str, log_level: str = "warning", output: Any = None) -> None:
        """``output``: a file the server's stdout and stderr go to (default: the test's)."""
        import subprocess
        import sys

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "phloem", "serve", "--port", str(self.port), "--log-level", log_level, *flags],
            stdout=output,
            stderr=None if output is None else subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 180.0) -> None:
        import time

        import requests

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError("server did not become healthy")

    def stop(self) -> int:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server():
    srv = ServerProcess()
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def float_server():
    """``server`` on exact float32 weights (see ``float_engine``)."""
    srv = ServerProcess("--quantization", "none")
    srv.wait_ready()
    yield srv
    srv.stop()
