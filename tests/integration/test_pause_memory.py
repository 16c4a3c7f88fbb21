"""pause_generation / continue_generation and release / resume_memory_occupation on the real
default model, over HTTP (the shared ``server``) and through the shared ``engine``.

A long greedy request is paused once it has streamed a few chunks; after continue its text must be
exactly that of an unpaused run (no token lost or repeated). Requests sent while paused or released
wait and complete afterwards. Each test leaves the engine continued and its memory resumed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import requests

PROMPT = "Write a long story about a lighthouse keeper and the sea."
SAMPLING = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
SHORT = {"max_new_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def engine(float_engine):
    """Exact float32 weights: these tests expect a retracted or re-prefilled request to continue
    with the same greedy text, which int8 activations (the default CPU path) do not promise."""
    return float_engine


@pytest.fixture(scope="module")
def server(float_server):
    """Exact float32 weights (see ``engine``)."""
    return float_server


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(url + path, json=body, timeout=300)


def stream_chunks(url: str, body: dict) -> Iterator[dict]:
    with requests.post(url + "/generate", json={**body, "stream": True}, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                yield json.loads(line[6:])


class Background:
    """Runs ``work(started)`` on a thread; ``started`` is set once some output came."""

    def __init__(self, work: Callable[[threading.Event], Any]) -> None:
        self.started = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.result = work(self.started)
            except BaseException as e:  # surfaced by join()
                self.error = e
                self.started.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 300) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the request did not complete"
        if self.error is not None:
            raise self.error
        return self.result


def last_chunk(chunks: Callable[[], Iterable[dict]]) -> Background:
    """A stream run in the background, whose result is its last chunk; started after 3 chunks."""

    def work(started: threading.Event) -> dict:
        last: dict = {}
        for i, chunk in enumerate(chunks()):
            last = chunk
            if i >= 2:
                started.set()
        started.set()
        return last

    return Background(work)


def http_stream(url: str, text: str, sampling: dict) -> Background:
    """A streamed /generate (``last_chunk``)."""
    return last_chunk(lambda: stream_chunks(url, {"text": text, "sampling_params": sampling}))


def engine_stream(engine: Any) -> Background:
    """``http_stream`` through ``Engine.generate(stream=True)``."""
    return last_chunk(lambda: engine.generate(PROMPT, sampling_params=SAMPLING, stream=True))


def server_info(url: str) -> dict:
    return requests.get(url + "/get_server_info", timeout=30).json()


@pytest.fixture(scope="module")
def reference(server) -> str:
    r = post(server.url, "/generate", {"text": PROMPT, "sampling_params": SAMPLING})
    assert r.status_code == 200
    return r.json()["text"]


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_http_pause_mid_request_then_continue_keeps_greedy_text(server, reference, mode):
    post(server.url, "/flush_cache", {})
    long = http_stream(server.url, PROMPT, SAMPLING)
    assert long.started.wait(120)
    try:
        r = post(server.url, "/pause_generation", {"mode": mode})
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert server_info(server.url)["generation_paused"] is True
        late = Background(lambda _: post(server.url, "/generate", {"text": "Hello", "sampling_params": SHORT}))
        time.sleep(1.0)
        assert long.thread.is_alive() and late.thread.is_alive()  # both wait while paused
        probe = requests.get(server.url + "/health_generate", timeout=10)  # at once, not after 20 s
        assert probe.status_code == 503 and probe.json()["status"] == "held"
    finally:
        assert post(server.url, "/continue_generation", {}).json()["success"] is True
    out = long.join()
    assert out["text"] == reference
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)
    answer = late.join()
    assert answer.status_code == 200 and answer.json()["meta_info"]["finish_reason"] is not None
    assert server_info(server.url)["generation_paused"] is False


def test_http_pause_abort_ends_requests_with_abort_and_200(server):
    long = Background(lambda _: post(server.url, "/generate", {"text": PROMPT, "sampling_params": SAMPLING}))
    deadline = time.time() + 60
    while server_info(server.url)["live"]["num_running_reqs"] == 0 and time.time() < deadline:
        time.sleep(0.05)
    try:
        assert post(server.url, "/pause_generation", {}).json()["success"] is True  # abort: the default
        r = long.join()
    finally:
        post(server.url, "/continue_generation", {})
    assert r.status_code == 200
    finish = r.json()["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and "status_code" not in finish
    assert r.json()["meta_info"]["completion_tokens"] < SAMPLING["max_new_tokens"]


def test_http_bad_bodies_name_the_field(server):
    r = post(server.url, "/pause_generation", {"mode": "later"})
    assert r.status_code == 400 and "mode" in r.text
    r = post(server.url, "/release_memory_occupation", {"tags": ["activations"]})
    assert r.status_code == 400 and "tags" in r.text


def test_http_release_and_resume_memory_keeps_greedy_text(server, reference):
    long = http_stream(server.url, PROMPT, SAMPLING)
    assert long.started.wait(120)
    r = post(server.url, "/release_memory_occupation", {"tags": None})
    assert r.status_code == 400 and r.json()["success"] is False and "pause" in r.json()["message"]
    assert long.join()["text"] == reference

    try:
        r = post(server.url, "/release_memory_occupation", {})
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        info = server_info(server.url)
        assert info["memory_released"] == ["kv_cache", "weights"]
        late = http_stream(server.url, PROMPT, SAMPLING)
        time.sleep(1.0)
        assert not late.started.is_set()  # waits while the memory is released
    finally:
        r = post(server.url, "/resume_memory_occupation", {"tags": ["kv_cache", "weights"]})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert late.join()["text"] == reference
    assert server_info(server.url)["memory_released"] == []


def test_engine_pause_retract_and_release_resume(engine):
    expected = engine.generate(PROMPT, sampling_params=SAMPLING)["text"]

    engine.flush_cache()
    long = engine_stream(engine)
    assert long.started.wait(120)
    try:
        assert engine.pause_generation("retract") == (True, "generation paused (mode retract)")
        assert engine.release_memory_occupation(["kv_cache"])[0] is True  # retracted: nothing holds KV
        assert engine.get_server_info()["memory_released"] == ["kv_cache"]
        assert engine.continue_generation()[0] is True
        time.sleep(0.5)
        assert long.thread.is_alive()  # the KV pool is still released
    finally:
        engine.continue_generation()
        assert engine.resume_memory_occupation()[0] is True
    assert long.join()["text"] == expected

    assert engine.release_memory_occupation()[0] is True
    assert engine.resume_memory_occupation()[0] is True
    assert engine.generate(PROMPT, sampling_params=SAMPLING)["text"] == expected


def test_engine_weight_update_while_paused_in_place_does_not_wait_for_the_paused_request(engine):
    """The update is applied while the request is held (it would otherwise wait for it forever);
    the request then continues on the new weights, here the same values, so with the same text."""
    from phloem.runtime.executor.weights_gguf import load_gguf_weights
    from phloem.runtime.model_files import default_model_path

    _, weights = load_gguf_weights(default_model_path())
    norm = {"model.norm.weight": weights["model.norm.weight"]}
    expected = engine.generate(PROMPT, sampling_params=SAMPLING)["text"]

    engine.flush_cache()
    long = engine_stream(engine)
    assert long.started.wait(120)
    try:
        assert engine.pause_generation("in_place")[0] is True
        update = Background(lambda _: engine.update_weights_from_tensor(norm))
        ok, message = update.join(timeout=60)
        assert ok, message
        assert long.thread.is_alive()  # still paused
    finally:
        engine.continue_generation()
    out = long.join()
    assert out["text"] == expected and out["meta_info"]["num_retractions"] == 0
