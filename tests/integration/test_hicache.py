"""The hierarchical cache through the Engine on the default model: a device pool too small for the
conversations, multi-turn sessions, host hits reported, and the same greedy text as without it."""

from __future__ import annotations

import pytest

GREEDY = {"temperature": 0, "max_new_tokens": 8}
SESSIONS, TURNS = 3, 3
TOPICS = ["rivers of Europe", "prime numbers", "baking bread"]


def converse(engine) -> tuple[list[list[int]], list[dict]]:
    """Round-robin sessions; each turn sends the whole conversation so far as token ids."""
    tok = engine.tm.tokenizer
    histories = []
    for s in range(SESSIONS):
        notes = " ".join(f"Note {i}: {TOPICS[s]} fact number {i} is worth remembering." for i in range(24))
        histories.append(tok.encode(f"System: you are assistant {s}, an expert on {TOPICS[s]}. {notes}"))
    outputs, metas = [], []
    for t in range(TURNS):
        for s in range(SESSIONS):
            prompt = histories[s] + tok.encode(f"\nUser: tell me more, part {t}.\nAssistant:")
            out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
            histories[s] = prompt + out["output_ids"]
            outputs.append(out["output_ids"])
            metas.append(out["meta_info"])
    return outputs, metas


def run_engine(**kw) -> tuple[list[list[int]], list[dict], dict]:
    from phloem import Engine

    with Engine(log_level="warning", max_total_tokens=640, enable_deterministic_inference=True, **kw) as eng:
        outputs, metas = converse(eng)
        live = eng.get_server_info()["live"]
    return outputs, metas, live


@pytest.fixture(scope="module")
def baseline():
    return run_engine()


def test_sessions_larger_than_the_device_pool_hit_the_host_and_match(baseline):
    outputs, metas, live = run_engine(enable_hierarchical_cache=True)
    assert outputs == baseline[0]
    later = metas[SESSIONS:]
    host = sum(m["cached_tokens_details"]["host"] for m in later)
    assert host > 0, [m["cached_tokens_details"] for m in metas]
    for m in metas:
        d = m["cached_tokens_details"]
        assert d["device"] + d["host"] + d["storage"] == m["cached_tokens"]
    assert live["hicache_host_hit_tokens"] == host and live["hicache_bytes_host_to_device"] > 0
    # without the host tier the later turns recomputed more of their history
    assert sum(m["cached_tokens"] for m in later) > sum(m["cached_tokens"] for m in baseline[1][SESSIONS:])


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_other_write_policies_give_the_same_text(baseline, policy):
    outputs, _, _ = run_engine(enable_hierarchical_cache=True, hicache_write_policy=policy)
    assert outputs == baseline[0]


def test_restarted_engine_serves_old_prefixes_from_storage(baseline, tmp_path):
    from phloem import Engine

    opts = dict(
        log_level="warning",
        max_total_tokens=640,
        enable_deterministic_inference=True,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
        hicache_storage_prefetch_policy="wait_complete",
    )
    with Engine(**opts) as eng:
        first, _ = converse(eng)
    with Engine(**opts) as eng:  # a new engine over the same directory
        tok = eng.tm.tokenizer
        notes = " ".join(f"Note {i}: {TOPICS[0]} fact number {i} is worth remembering." for i in range(24))
        prompt = tok.encode(f"System: you are assistant 0, an expert on {TOPICS[0]}. {notes}")
        prompt += tok.encode("\nUser: tell me more, part 0.\nAssistant:")
        out = eng.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == first[0] == baseline[0][0]
    assert out["meta_info"]["cached_tokens_details"]["storage"] >= 256
