"""The hierarchical cache through the Engine on the default model: a device pool too small for the
conversations, multi-turn sessions, host hits reported, and the same greedy text as without it.

Every engine of this module is started once, by the module fixture ``runs``, which drives all of
them side by side (one CPU thread each, so that they share the cores instead of fighting over them);
each engine still serves its own conversation one request at a time, and the deterministic
(batch-invariant) kernels make its greedy text independent of the cache hits. The tests then
compare what the runs recorded.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

GREEDY = {"temperature": 0, "max_new_tokens": 8}
SESSIONS, TURNS = 3, 3
TOPICS = ["rivers of Europe", "prime numbers", "baking bread"]
# 16 notes: first prompts of 265-282 tokens, so that session 0's first prompt spans four 64-token
# storage pages, which is the storage tier's prefetch threshold (256 tokens)
NOTES = 16
# the device pool holds about 1.6 first prompts: three sessions overflow it, and the host pool (2x)
# overflows too by the last turn
POOL = 448
ENGINE = dict(log_level="warning", max_total_tokens=POOL, enable_deterministic_inference=True, cpu_threads=1)
HICACHE = dict(enable_hierarchical_cache=True)
OTHER_POLICIES = ["write_through_selective", "write_back"]  # write_through is the default


def system_prompt(tok, s: int) -> list[int]:
    notes = " ".join(f"Note {i}: {TOPICS[s]} fact number {i} is worth remembering." for i in range(NOTES))
    return tok.encode(f"System: you are assistant {s}, an expert on {TOPICS[s]}. {notes}")


def user_turn(tok, t: int) -> list[int]:
    return tok.encode(f"\nUser: tell me more, part {t}.\nAssistant:")


def converse(engine, turns: int = TURNS) -> tuple[list[list[int]], list[dict]]:
    """Round-robin sessions; each turn sends the whole conversation so far as token ids."""
    tok = engine.tm.tokenizer
    histories = [system_prompt(tok, s) for s in range(SESSIONS)]
    outputs, metas = [], []
    for t in range(turns):
        for s in range(SESSIONS):
            prompt = histories[s] + user_turn(tok, t)
            out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
            histories[s] = prompt + out["output_ids"]
            outputs.append(out["output_ids"])
            metas.append(out["meta_info"])
    return outputs, metas


def run_engine(**kw) -> tuple[list[list[int]], list[dict], dict]:
    from phloem import Engine

    with Engine(**ENGINE, **kw) as eng:
        outputs, metas = converse(eng)
        live = eng.get_server_info()["live"]
    return outputs, metas, live


def run_storage_restart(storage_dir: str) -> tuple[list[list[int]], dict]:
    """The first turn of every session (more than the device pool holds) on an engine with a file
    storage tier, then a new engine over the same directory asked session 0's first prompt again."""
    from phloem import Engine

    opts = dict(
        ENGINE,
        **HICACHE,
        hicache_storage_backend="file",
        hicache_storage_dir=storage_dir,
        hicache_storage_prefetch_policy="wait_complete",
    )
    with Engine(**opts) as eng:
        first, _ = converse(eng, turns=1)
    with Engine(**opts) as eng:  # a new engine over the same directory
        tok = eng.tm.tokenizer
        out = eng.generate(input_ids=system_prompt(tok, 0) + user_turn(tok, 0), sampling_params=GREEDY)
    return first, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """name -> what its run returned (all of them, whichever tests were selected); each engine is
    shut down when its run ends (``with``)."""
    jobs = {
        "baseline": (run_engine, {}),
        "write_through": (run_engine, HICACHE),
        **{p: (run_engine, dict(HICACHE, hicache_write_policy=p)) for p in OTHER_POLICIES},
        "storage": (run_storage_restart, {"storage_dir": str(tmp_path_factory.mktemp("hicache-storage"))}),
    }
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(fn, **kw) for name, (fn, kw) in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def baseline(runs):
    return runs["baseline"]


def host_hits(metas: list[dict]) -> int:
    return sum(m["cached_tokens_details"]["host"] for m in metas)


def test_sessions_larger_than_the_device_pool_hit_the_host_and_match(runs, baseline):
    outputs, metas, live = runs["write_through"]
    assert outputs == baseline[0]
    later = metas[SESSIONS:]
    host = host_hits(later)
    assert host > 0, [m["cached_tokens_details"] for m in metas]
    for m in metas:
        d = m["cached_tokens_details"]
        assert d["device"] + d["host"] + d["storage"] == m["cached_tokens"]
    assert live["hicache_host_hit_tokens"] == host and live["hicache_bytes_host_to_device"] > 0
    # without the host tier the later turns recomputed more of their history
    assert sum(m["cached_tokens"] for m in later) > sum(m["cached_tokens"] for m in baseline[1][SESSIONS:])


@pytest.mark.parametrize("policy", OTHER_POLICIES)
def test_other_write_policies_give_the_same_text(runs, baseline, policy):
    outputs, metas, live = runs[policy]
    assert outputs == baseline[0]
    # the policy did copy KV to the host: write_back what the device evicted (which the later turns
    # loaded back); write_through_selective only what a second request reused while it was still on
    # the device, which in these round-robin sessions is just the prefix they all share
    assert live["hicache_backed_up_tokens"] > 0, live
    if policy == "write_back":
        assert live["hicache_evicted_to_host_tokens"] > 0, live
        assert host_hits(metas[SESSIONS:]) > 0, [m["cached_tokens_details"] for m in metas]


def test_restarted_engine_serves_old_prefixes_from_storage(runs, baseline):
    first, out = runs["storage"]
    assert out["output_ids"] == first[0] == baseline[0][0]
    assert first == baseline[0][:SESSIONS]  # the storage tier does not change the text either
    assert out["meta_info"]["cached_tokens_details"]["storage"] >= 256
