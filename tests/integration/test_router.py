"""Data parallelism on the default model: ``phloem serve --dp-size 2`` (two workers behind the
router), and ``phloem router`` over the same workers.

One module-wide server keeps the test time down; the test that kills a worker runs last.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from tests.integration.conftest import ServerProcess, free_port

GREEDY = {"temperature": 0, "max_new_tokens": 6}
WORDS = "river stone lamp orbit cedar violet engine harbor quartz meadow signal lantern copper tide falcon".split()


@pytest.fixture(scope="module")
def dp() -> Iterator[ServerProcess]:
    # one torch thread per worker: two workers on a small machine would fight over every core
    srv = ServerProcess("--dp-size", "2", "--max-total-tokens", "4096", "--cpu-threads", "1")
    srv.wait_ready(timeout=300)
    yield srv
    srv.stop()


def workers(srv: ServerProcess) -> list[dict[str, Any]]:
    return requests.get(srv.url + "/workers", timeout=10).json()["workers"]


def generate(url: str, text: str, params: dict[str, Any] = GREEDY, **extra: Any) -> requests.Response:
    body = {"text": text, "sampling_params": params, **extra}
    return requests.post(url + "/generate", json=body, timeout=120)


def test_dp_serve_starts_two_healthy_workers_behind_the_router(dp):
    ws = workers(dp)
    assert len(ws) == 2 and all(w["healthy"] for w in ws)
    r = generate(dp.url, "The capital of France is")
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] > 0
    assert r.headers["x-phloem-worker"] in {w["url"] for w in ws}
    info = requests.get(dp.url + "/get_server_info", timeout=10).json()
    assert info["dp_size"] == 2 and len(info["workers"]) == 2


def shared_prefix_workload(groups: int = 4, per_group: int = 6) -> list[tuple[int, str]]:
    """Interleaved: the prompts of each group share a ~300-token prefix and differ at the end."""
    rng = random.Random(7)
    prefixes = [f"Notes of team {g}: " + " ".join(rng.choice(WORDS) for _ in range(280)) for g in range(groups)]
    return [(g, f"{prefixes[g]}\nQuestion {i}: what comes next?") for i in range(per_group) for g in range(groups)]


def hit_rate(outs: list[dict[str, Any]]) -> float:
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    return cached / sum(o["meta_info"]["prompt_tokens"] for o in outs)


def test_groups_sharing_a_prefix_land_on_one_replica_and_keep_the_single_replica_hit_rate(dp):
    workload = shared_prefix_workload()
    one = workers(dp)[0]["url"]
    assert requests.post(dp.url + "/flush_cache", timeout=30).json()["success"]
    first = {"temperature": 0, "max_new_tokens": 1}  # only the prefill is measured
    single = [generate(one, text, first).json() for _, text in workload]
    assert requests.post(dp.url + "/flush_cache", timeout=30).json()["success"]

    placed: dict[int, set[str]] = {}
    routed = []
    for group, text in workload:
        r = generate(dp.url, text, first)
        assert r.status_code == 200
        placed.setdefault(group, set()).add(r.headers["x-phloem-worker"])
        routed.append(r.json())
    assert all(len(urls) == 1 for urls in placed.values()), placed
    assert len(set().union(*placed.values())) == 2  # both replicas work
    single_rate, dp_rate = hit_rate(single), hit_rate(routed)
    assert single_rate > 0.6  # the workload does share its prefixes
    assert abs(dp_rate - single_rate) <= 0.05, (single_rate, dp_rate)
    metrics = requests.get(dp.url + "/metrics", timeout=10).text
    hits = [line for line in metrics.splitlines() if line.startswith("phloem_router_worker_cache_aware_hits_total")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in hits) >= len(workload) - 4


def test_streams_through_the_router_equal_the_unstreamed_answer(dp):
    prompt = "Write a short list of three fruits:"
    whole = generate(dp.url, prompt).json()["text"]
    with requests.post(
        dp.url + "/generate", json={"text": prompt, "sampling_params": GREEDY, "stream": True}, stream=True, timeout=120
    ) as r:
        events = [line[len("data: ") :] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    assert json.loads(events[-2])["text"] == whole  # native chunks are cumulative


def test_the_openai_client_works_against_the_router(dp):
    import openai

    client = openai.OpenAI(base_url=dp.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    args: dict[str, Any] = {"model": model, "max_tokens": 6, "temperature": 0}
    whole = client.completions.create(prompt="Once upon a time", **args).choices[0].text
    parts = client.completions.create(prompt="Once upon a time", stream=True, **args)
    assert "".join(c.choices[0].text for c in parts if c.choices) == whole
    messages: Any = [{"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(messages=messages, **args).choices[0].message.content
    stream = client.chat.completions.create(messages=messages, stream=True, **args)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat


def test_phloem_router_over_the_same_workers_round_robin(dp):
    urls = [w["url"] for w in workers(dp)]
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "phloem", "router", "--worker-urls", *urls, "--port", str(port),
         "--policy", "round_robin", "--log-level", "warning"],
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.time() < deadline and proc.poll() is None, "router did not start"
            time.sleep(0.2)
        seen = {generate(url, "Hello").headers["x-phloem-worker"] for _ in range(2)}
        assert seen == set(urls)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def _worker_pid(srv: ServerProcess, url: str) -> int:
    """The pid of the ``phloem serve`` child serving ``url`` (its command line names the port)."""
    port = url.rsplit(":", 1)[1]
    with open(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if b"--port" in argv and argv[argv.index(b"--port") + 1].decode() == port:
            return pid
    raise AssertionError(f"no worker process serves {url}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the worker's pid in /proc")
def test_killing_a_worker_mid_run_fails_no_request_and_reports_it(dp):
    """Runs last: it leaves one worker dead."""
    victim = workers(dp)[1]["url"]
    pid = _worker_pid(dp, victim)
    prompts = [f"Story {i}: the " + " ".join(WORDS[i:] + WORDS[:i]) for i in range(10)]
    with ThreadPoolExecutor(6) as pool:
        params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
        futures = [pool.submit(generate, dp.url, p, params) for p in prompts]
        deadline = time.time() + 30  # kill the victim while it holds requests (decoding is fast)
        while not next(w for w in workers(dp) if w["url"] == victim)["in_flight"]:
            assert time.time() < deadline, "no request reached the victim"
            time.sleep(0.02)
        subprocess.run(["kill", "-KILL", str(pid)], check=True)
        answers = [f.result() for f in futures]
    assert [r.status_code for r in answers] == [200] * len(prompts), [r.text for r in answers if r.status_code != 200]
    after = [generate(dp.url, "After the crash,") for _ in range(3)]
    assert all(r.status_code == 200 and r.headers["x-phloem-worker"] != victim for r in after)
    # reported by the next health checks (every 2 s; out after 2 failed ones or a refused connection)
    deadline = time.time() + 15
    state = {w["url"]: w for w in workers(dp)}
    while state[victim]["healthy"] and time.time() < deadline:
        time.sleep(0.5)
        state = {w["url"]: w for w in workers(dp)}
    assert state[victim]["healthy"] is False and state[victim]["last_error"]
    metrics = requests.get(dp.url + "/metrics", timeout=10).text
    assert f'phloem_router_worker_healthy{{worker="{victim}"}} 0.0' in metrics
    retries = next(line for line in metrics.splitlines() if line.startswith("phloem_router_retries_total"))
    assert float(retries.split()[1]) >= 1  # requests in flight on the victim went to the other worker
    assert requests.get(dp.url + "/health", timeout=10).json()["healthy_workers"] == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_workers_do_not_outlive_a_killed_router(dp):
    """Runs after the crash test: the surviving worker must exit when the router is SIGKILLed."""
    survivors = [_worker_pid(dp, w["url"]) for w in workers(dp) if w["healthy"]]
    assert survivors
    dp.proc.kill()
    dp.proc.wait(timeout=10)
    deadline = time.time() + 30
    while any(_alive(pid) for pid in survivors):
        assert time.time() < deadline, "a worker outlived its router"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
