"""``run_server`` as a real process: readiness line, SIGTERM drain, exit on a broken engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = (
    "import sys; sys.path.insert(0, {here!r});"
    "from tests.unit.test_server_fake_tm import fake_factory;"
    "from phloem.runtime.config import EngineArgs;"
    "from phloem.runtime.server.app import run_server;"
    "raise SystemExit(run_server(EngineArgs(port=0, log_level='warning'), fake_factory))"
)


def start_server(**env: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH.format(here=str(ROOT))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **env},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("phloem serving at "):
            return proc, line.split(" at ", 1)[1].strip()
        if not line and proc.poll() is not None:
            break
    proc.kill()
    pytest.fail(f"server did not start: {proc.stdout.read()}")


def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ready_line_serves_on_loopback_and_sigterm_exits_zero():
    proc, url = start_server()
    assert url.startswith("http://127.0.0.1:")
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.json()["text"] == "hi"
    proc.send_signal(signal.SIGTERM)
    assert wait_exit(proc, 15) == 0


def test_sigterm_aborts_in_flight_requests_with_503():
    proc, url = start_server()
    result: dict = {}

    def slow_request():
        body = {"text": "SLOW", "sampling_params": {"max_new_tokens": 100}}
        result["r"] = httpx.post(url + "/generate", json=body, timeout=30)

    thread = threading.Thread(target=slow_request)
    thread.start()
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    thread.join(timeout=15)
    assert result["r"].status_code == 503
    assert wait_exit(proc, 15) == 0


def test_broken_engine_exits_non_zero_within_seconds():
    proc, url = start_server(PHLOEM_FAKE_BREAK_AFTER="0.5")
    start = time.monotonic()
    code = wait_exit(proc, 15)
    assert code != 0
    assert time.monotonic() - start < 5
