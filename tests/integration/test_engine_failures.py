"""Engines with unusual settings: a tiny KV pool, deterministic mode, a killed child process."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from phloem.runtime.errors import InvalidRequest

from phloem import Engine

from .conftest import pool_is_idle


def test_tiny_pool_retracts_and_all_requests_finish_correctly():
    # 32 requests of ~20 prompt tokens each wanting up to 32 more: far more than 400 slots. An
    # optimistic forecast (low conservativeness) admits too many, so some must be retracted.
    prompts = [f"Request {i}: list the even numbers starting at {2 * i}:" for i in range(32)]
    params = {"max_new_tokens": 32, "temperature": 0}
    with Engine(max_total_tokens=400, max_running_requests=32, schedule_conservativeness=0.3,
                enable_deterministic_inference=True, log_level="warning") as eng:
        outs = eng.generate(prompts, sampling_params=params)
        assert all(o["meta_info"]["finish_reason"]["type"] in ("length", "stop") for o in outs)
        assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0
        # correctness: a retracted request's output equals the same request run alone
        worst = max(range(32), key=lambda i: outs[i]["meta_info"]["num_retractions"])
        alone = eng.generate(prompts[worst], sampling_params=params)
        assert alone["output_ids"] == outs[worst]["output_ids"]
        assert pool_is_idle(eng.get_server_info()) or eng.flush_cache()


def test_deterministic_mode_is_batch_and_cache_invariant():
    prompt = "Explain why the sky is blue in one paragraph."
    params = {"max_new_tokens": 32, "temperature": 0}
    others = [f"Write item {i} of a shopping list with {i} words:" * (1 + i % 3) for i in range(15)]
    with Engine(enable_deterministic_inference=True, log_level="warning") as eng:
        alone = eng.generate(prompt, sampling_params=params)["output_ids"]
        batch = eng.generate(others[:7] + [prompt] + others[7:], sampling_params=params)
        assert batch[7]["output_ids"] == alone
        cached = eng.generate(prompt, sampling_params=params)  # prefix now comes from the tree
        assert cached["meta_info"]["cached_tokens"] > 0
        assert cached["output_ids"] == alone


def test_killed_scheduler_fails_pending_requests_quickly():
    eng = Engine(log_level="warning")
    try:
        results = {}

        def run():
            results["out"] = eng.generate("Tell me a very long story.", sampling_params={"max_new_tokens": 2000, "ignore_eos": True})

        t = threading.Thread(target=run)
        t.start()
        time.sleep(1.0)
        sched = next(p for p in eng._procs.procs if p.name == "phloem-scheduler")
        os.kill(sched.pid, signal.SIGKILL)
        t0 = time.time()
        t.join(timeout=10)
        assert not t.is_alive(), "pending request did not fail within 10 s"
        reason = results["out"]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "died" in reason["message"]
        assert time.time() - t0 < 10
        assert eng.health() == "broken"
        with pytest.raises(InvalidRequest, match="broken"):
            eng.generate("hello")
    finally:
        eng.shutdown()
