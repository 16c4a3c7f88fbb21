"""A frozen engine does not look healthy: ``phloem serve`` on the real default model with its
scheduler process stopped (SIGSTOP). /health turns 503 "stalled" within seconds and back to 200 once
the process continues; /server_info answers at once meanwhile; a stop longer than
``--watchdog-timeout`` ends the server with a non-zero exit and no child left behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import requests
from phloem.runtime.tokenizer.liveness import SILENCE_STALL_S

from .conftest import ServerProcess

# Slack for a loaded two-core machine on top of the thresholds under test.
SLACK_S = 10.0


def _wait_status(url: str, status: int, timeout: float) -> requests.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = requests.get(url + "/health", timeout=5)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (Linux /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _running(pid: int) -> bool:
    """Exists and is not a zombie (a zombie has ended; only its exit status waits to be read)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _scheduler_pid(srv: ServerProcess) -> int:
    return int(requests.get(srv.url + "/get_server_info", timeout=30).json()["pid"])


GENERATE = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}


def test_a_stopped_scheduler_is_reported_stalled_then_recovers():
    srv = ServerProcess()
    try:
        srv.wait_ready()
        pid = _scheduler_pid(srv)
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            r = _wait_status(srv.url, 503, SILENCE_STALL_S + SLACK_S)
            assert r.status_code == 503, r.text
            assert time.monotonic() - start >= SILENCE_STALL_S - 1.5  # not before the threshold
            body = r.json()
            assert body["status"] == "stalled" and body["message"].startswith("no scheduler heartbeat for ")

            t0 = time.monotonic()
            info = requests.get(srv.url + "/get_server_info", timeout=10).json()
            assert time.monotonic() - t0 < 2.5
            assert info["status"] == "stalled" and info["live"] is None and info["live_unavailable"]
            assert info["pid"] == pid  # the static part is there

            gen = requests.post(srv.url + "/generate", json=GENERATE, timeout=10)
            assert gen.status_code == 503 and "stalled" in gen.json()["error"]["message"]
            metrics = requests.get(srv.url + "/metrics", timeout=10).text
            [age] = [
                m for m in metrics.splitlines() if m.startswith("phloem:scheduler_heartbeat_age_seconds{")
            ]
            assert float(age.rsplit(" ", 1)[1]) > SILENCE_STALL_S
        finally:
            os.kill(pid, signal.SIGCONT)
        r = _wait_status(srv.url, 200, SLACK_S)
        assert r.status_code == 200 and r.json() == {"status": "serving"}
        gen = requests.post(srv.url + "/generate", json=GENERATE, timeout=60)
        assert gen.status_code == 200, gen.text
        assert requests.get(srv.url + "/get_server_info", timeout=30).json()["live"]["num_running_reqs"] == 0
        assert srv.stop() == 0  # the stall left nothing behind that a clean shutdown trips on
    finally:
        srv.stop()


def test_a_stop_past_the_watchdog_timeout_ends_the_server_non_zero_without_orphans():
    watchdog = 6.0
    srv = ServerProcess("--watchdog-timeout", str(watchdog))
    children: set[int] = set()
    try:
        srv.wait_ready()
        pid = _scheduler_pid(srv)
        children = _descendants(srv.proc.pid)
        assert pid in children and len(children) >= 2  # the scheduler and the detokenizer
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        code = srv.proc.wait(timeout=watchdog + 3 * SLACK_S)
        assert code != 0
        assert time.monotonic() - start >= watchdog - 1.5  # the watchdog, not something sooner
        deadline = time.monotonic() + 5
        while any(map(_running, children)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [c for c in children if _running(c)], "children outlived the server"
    finally:
        srv.stop()
        for child in children:  # whatever the outcome, leave no stopped process behind
            if _running(child):
                os.kill(child, signal.SIGKILL)


def test_a_step_longer_than_the_watchdog_timeout_ends_the_scheduler_with_one_line(tmp_path):
    # One prefill pass over a ~6000-token prompt on one CPU thread (some 1.6 TFLOP) takes well over
    # the timeout on any machine: a stand-in for a step that never returns. The heartbeat thread
    # keeps beating meanwhile, so it is the scheduler's own watchdog that acts, naming the step.
    watchdog = 3.0
    flags = ["--watchdog-timeout", str(watchdog), "--chunked-prefill-size", "8192", "--cpu-threads", "1"]
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        srv = ServerProcess(*flags, log_level="info", output=log)
        try:
            srv.wait_ready()
            body = {"text": "the cat sat on the mat " * 1000, "sampling_params": {"max_new_tokens": 1}}
            r = requests.post(srv.url + "/generate", json=body, timeout=120)
            assert r.status_code == 503, r.text  # the request fails, it does not hang
            assert srv.proc.wait(timeout=SLACK_S) != 0
        finally:
            srv.stop()
    text = log_path.read_text()
    lines = [line for line in text.splitlines() if "watchdog:" in line]
    assert len(lines) == 1, text[-3000:]
    assert "EXTEND" in lines[0] and f"--watchdog-timeout {watchdog:g}" in lines[0]
    assert "child process died: phloem-scheduler (exit code 3)" in text
