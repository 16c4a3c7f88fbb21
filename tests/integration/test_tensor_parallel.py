"""Tensor parallelism on the real default model, CPU ranks over gloo.

SmolLM2-135M has 9 query heads and 3 KV heads, so ``--tp-size 3`` gives each rank 3 query heads
and one KV head. Greedy tokens must equal the single-rank engine's, in float32, through the HTTP
server (three nodes of one rank each, started as separate ``phloem serve`` commands, the way a
multi-node engine starts) and through an in-process ``Engine`` (one node, three ranks).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import requests

from .conftest import ServerProcess, free_port

pytestmark = pytest.mark.timeout(600)

FLAGS = ("--quantization", "none", "--dtype", "float32", "--max-total-tokens", "4096")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours of the rainbow:",
    "Water boils at a temperature of",
]
NEW_TOKENS = 16


def _greedy(url: str) -> list[list[int]]:
    body = {"text": PROMPTS, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    r = requests.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [out["output_ids"] for out in r.json()]


@pytest.fixture(scope="module")
def single_rank():
    srv = ServerProcess(*FLAGS)
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def three_nodes():
    """Node 0 serves; nodes 1 and 2 run one follower rank each (``--node-rank r``)."""
    addr = f"127.0.0.1:{free_port()}"
    common = ("--tp-size", "3", "--nnodes", "3", "--dist-init-addr", addr, *FLAGS)
    others = [
        subprocess.Popen([sys.executable, "-m", "phloem", "serve", "--log-level", "warning", *common,
                          "--node-rank", str(r)])  # fmt: skip
        for r in (1, 2)
    ]
    srv = ServerProcess(*common, "--node-rank", "0")
    try:
        srv.wait_ready()
    except BaseException:
        for p in others:
            p.kill()
        srv.stop()
        raise
    yield srv, others
    srv.stop()
    for p in others:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def test_three_nodes_generate_the_single_rank_tokens(single_rank, three_nodes) -> None:
    srv, _ = three_nodes
    assert _greedy(srv.url) == _greedy(single_rank.url)
    info = requests.get(srv.url + "/get_server_info", timeout=10).json()
    assert info["tp_size"] == 3


def test_streaming_under_tensor_parallelism_matches(three_nodes) -> None:
    srv, _ = three_nodes
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    whole = requests.post(srv.url + "/generate", json=body, timeout=60).json()["text"]
    with requests.post(srv.url + "/generate", json={**body, "stream": True}, timeout=60, stream=True) as r:
        chunks = [line for line in r.iter_lines() if line.startswith(b"data:") and b"[DONE]" not in line]
    import json

    assert json.loads(chunks[-1][5:])["text"] == whole


def test_weight_routes_are_refused_with_a_reason(three_nodes) -> None:
    srv, _ = three_nodes
    r = requests.post(srv.url + "/get_weights_by_name", json={"name": "model.norm.weight"}, timeout=30)
    assert r.status_code >= 400 and "--tp-size" in r.text
    r = requests.post(srv.url + "/release_memory_occupation", json={}, timeout=30)
    assert r.status_code >= 400 and "--tp-size" in r.text


def test_follower_nodes_exit_cleanly_with_node_zero(three_nodes) -> None:
    """Runs last in this module: stopping node 0 sends the stop to every rank."""
    srv, others = three_nodes
    assert srv.stop() == 0
    codes = [p.wait(timeout=60) for p in others]
    assert codes == [0, 0]


def _engine_greedy(engine) -> list[list[int]]:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    return [out["output_ids"] for out in engine.generate(PROMPTS, sampling_params=params)]


def _failure(engine) -> str:
    """The error of one short request ("" when it succeeded)."""
    try:
        out = engine.generate(PROMPTS[0], sampling_params={"max_new_tokens": 8})
    except Exception as e:  # noqa: BLE001 - any error the engine raises is the answer
        return str(e)
    reason = out["meta_info"]["finish_reason"] or {}
    return str(reason.get("message", "")) if reason.get("type") == "abort" else ""


def test_engine_on_one_node_and_a_dead_rank(single_rank) -> None:
    """``Engine(tp_size=3)`` spawns its two followers itself and runs the overlap loop; killing a
    follower fails the next request with an error instead of hanging it."""
    import os
    import signal

    from phloem import Engine

    # the overlap loop: rank 0 sends each step from its forward thread while it schedules the next
    engine = Engine(tp_size=3, quantization="none", dtype="float32", max_total_tokens=4096, log_level="error",
                    enable_cpu_overlap_schedule=True)  # fmt: skip
    try:
        assert _engine_greedy(engine) == _greedy(single_rank.url)
        follower = next(p for p in engine._procs.procs if p.name == "phloem-tp-rank-2")
        os.kill(follower.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        failure = ""
        while not failure and time.monotonic() < deadline:
            failure = _failure(engine)
        assert "engine failure" in failure and "phloem-tp-rank-2" in failure
    finally:
        engine.shutdown()
