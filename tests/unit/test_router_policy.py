"""The router's text tree and routing policies, with a fake clock and hand-set loads."""

from __future__ import annotations

import random

import pytest
from phloem.runtime.router.policy import (
    CacheAwarePolicy,
    RoundRobinPolicy,
    ShortestQueuePolicy,
    make_policy,
)
from phloem.runtime.router.tree import TextTree
from phloem.runtime.router.worker import Worker, normalize_url


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0  # every reading is a later time: access order is insert order
        return self.now


# ---- tree ----------------------------------------------------------------------------------------
def test_match_is_the_longest_stored_prefix():
    t = TextTree(clock=Clock())
    assert t.match("anything") == 0
    t.insert("hello world")
    assert t.match("hello world") == 11
    assert t.match("hello there") == 6
    assert t.match("help") == 3
    assert t.match("hello world, again") == 11
    assert t.match("") == 0
    assert t.match("x") == 0


def test_split_edges_keep_both_branches_and_count_each_character_once():
    t = TextTree(clock=Clock())
    t.insert("abcdef")
    t.insert("abcxyz")
    t.insert("abc")
    assert t.size == len("abc") + len("def") + len("xyz")
    assert t.match("abcdefg") == 6 and t.match("abcxyq") == 5 and t.match("abq") == 2


def test_random_texts_match_a_brute_force_longest_common_prefix():
    rng = random.Random(0)
    t = TextTree(clock=Clock())
    stored: list[str] = []
    for _ in range(300):
        s = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        t.insert(s)
        stored.append(s)
    for _ in range(300):
        q = "".join(rng.choice("ab") for _ in range(rng.randint(0, 14)))
        expected = max(len(_common(q, s)) for s in stored)
        assert t.match(q) == expected, q
    assert t.size == _distinct_prefix_chars(stored)


def _common(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _distinct_prefix_chars(texts: list[str]) -> int:
    return len({s[:i] for s in texts for i in range(1, len(s) + 1)})


def test_cap_evicts_the_least_recently_used_text_first():
    t = TextTree(max_chars=25, clock=Clock())
    t.insert("a" * 10)
    t.insert("b" * 10)
    t.match("a" * 10)  # matching is not a use: only routing there (insert) is
    t.insert("a" * 10)  # a is now more recent than b
    t.insert("c" * 10)  # 30 > 25: b goes
    assert t.size == 20
    assert t.match("a" * 10) == 10 and t.match("c" * 10) == 10
    assert t.match("b" * 10) == 0


def test_eviction_keeps_a_shared_prefix_that_a_recent_text_still_uses():
    t = TextTree(max_chars=30, clock=Clock())
    t.insert("prefix-old-tail")
    t.insert("prefix-new-tail")
    t.insert("z" * 12)  # 7 + 8 + 8 + 12 = 35 > 30: the oldest leaf ("old-tail") goes
    assert t.match("prefix-new-tail") == 15
    assert t.match("prefix-old-tail") == 7
    assert t.size <= 30


def test_a_text_larger_than_the_cap_is_not_kept():
    t = TextTree(max_chars=5, clock=Clock())
    t.insert("0123456789")
    assert t.size == 0 and t.match("0123") == 0


def test_clear_and_bad_cap():
    t = TextTree(clock=Clock())
    t.insert("abc")
    t.clear()
    assert t.size == 0 and t.match("abc") == 0
    with pytest.raises(ValueError, match="max_chars"):
        TextTree(max_chars=0)


# ---- cache-aware policy --------------------------------------------------------------------------
def workers(n: int, **loads: int) -> list[Worker]:
    return [Worker(f"http://w{i}", healthy=True, in_flight=loads.get(f"w{i}", 0)) for i in range(n)]


PREFIX = "You are a helpful assistant. " * 20  # 580 characters shared by a group


def test_a_group_sharing_a_prefix_stays_on_one_worker_and_groups_spread():
    policy = CacheAwarePolicy(clock=Clock())
    ws = workers(2)
    placed: dict[str, set[str]] = {}
    for i in range(6):
        for group in "ABCD":
            w = policy.choose(ws, [f"{group}: {PREFIX} question {i}"]).worker
            placed.setdefault(group, set()).add(w.url)
    assert all(len(urls) == 1 for urls in placed.values()), placed
    # the first text of each new group went to the worker caching the least text
    assert sorted(next(iter(u)) for u in placed.values()) == ["http://w0", "http://w0", "http://w1", "http://w1"]


def test_a_match_below_the_threshold_goes_to_the_least_loaded_worker():
    policy = CacheAwarePolicy(cache_threshold=0.5, clock=Clock())
    w0, w1 = workers(2, w0=1)
    policy.tree(w0.url).insert("abcdefghij")
    choice = policy.choose([w0, w1], ["abcdZZZZZZ"])  # 4/10 cached on w0
    assert choice.worker is w1 and not choice.cache_hit
    choice = policy.choose([w0, w1], ["abcdefZZZZ"])  # 6/10 cached on w0: follow it despite its load
    assert choice.worker is w0 and choice.cache_hit and choice.matched == 6


def test_the_chosen_worker_learns_the_text():
    policy = CacheAwarePolicy(clock=Clock())
    w0, w1 = workers(2, w0=3)
    assert policy.choose([w0, w1], ["new text", "second of a batch"]).worker is w1
    assert policy.tree(w1.url).match("new text") == 8
    assert policy.tree(w1.url).match("second of a batch") == 17
    assert policy.tree(w0.url).size == 0


def test_uneven_loads_ignore_the_cache():
    text = PREFIX + "q"
    w0, w1 = workers(2)
    for busy, idle, follows_cache in [
        (16, 0, True),  # absolute gap 16: not more than 16
        (17, 0, False),  # gap 17 and 17 > 2 * 0
        (40, 20, True),  # gap 20 but 40 is not more than 2 * 20
        (41, 20, False),
    ]:
        policy = CacheAwarePolicy(balance_abs_threshold=16, balance_rel_threshold=2.0, clock=Clock())
        policy.tree(w0.url).insert(text)  # only w0 caches it
        w0.in_flight, w1.in_flight = busy, idle
        choice = policy.choose([w0, w1], [text])
        assert (choice.worker is w0) == follows_cache, (busy, idle)
        assert choice.cache_hit == follows_cache


def test_total_tokens_load_method():
    policy = CacheAwarePolicy(load_method="total_tokens", clock=Clock())
    w0, w1 = workers(2, w0=1)  # fewer requests on w1, but more tokens
    w0.in_flight_tokens, w1.in_flight_tokens = 100, 5000
    assert policy.choose([w0, w1], ["fresh"]).worker is w0


def test_ties_on_a_match_go_to_the_less_loaded_worker():
    policy = CacheAwarePolicy(clock=Clock())
    w0, w1 = workers(2, w0=2, w1=1)
    policy.tree(w0.url).insert("shared text")
    policy.tree(w1.url).insert("shared text")
    assert policy.choose([w0, w1], ["shared text!"]).worker is w1


def test_empty_text_balances_and_is_not_stored():
    policy = CacheAwarePolicy(clock=Clock())
    w0, w1 = workers(2, w0=1)
    assert policy.choose([w0, w1], []).worker is w1
    assert policy.choose([w0, w1], [""]).worker is w1
    assert policy.tree(w1.url).size == 0


def test_forget_and_reset_drop_what_a_worker_cached():
    policy = CacheAwarePolicy(clock=Clock())
    w0, w1 = workers(2)
    policy.choose([w0, w1], [PREFIX])
    owner = w0 if policy.tree(w0.url).size else w1
    policy.forget(owner.url)
    assert policy.tree(owner.url).size == 0
    policy.choose([w0, w1], [PREFIX])
    policy.reset()
    assert policy.tree(w0.url).size == 0 and policy.tree(w1.url).size == 0


# ---- other policies ------------------------------------------------------------------------------
def test_round_robin_cycles_over_the_given_workers():
    policy = RoundRobinPolicy()
    ws = workers(3)
    assert [policy.choose(ws, ["x"]).worker.url for _ in range(4)] == [
        "http://w0", "http://w1", "http://w2", "http://w0",
    ]  # fmt: skip


def test_shortest_queue_takes_the_least_loaded():
    ws = workers(3, w0=4, w1=1, w2=2)
    assert ShortestQueuePolicy().choose(ws, ["x"]).worker.url == "http://w1"


def test_make_policy_names():
    assert make_policy("cache_aware").name == "cache_aware"
    assert make_policy("round_robin").name == "round_robin"
    assert make_policy("shortest_queue", load_method="total_tokens").name == "shortest_queue"
    with pytest.raises(ValueError, match="--policy"):
        make_policy("random")


def test_worker_urls_are_normalized():
    assert normalize_url("localhost:8000/") == "http://localhost:8000"
    assert normalize_url("https://a.b:1") == "https://a.b:1"
    with pytest.raises(ValueError, match="--worker-urls"):
        normalize_url("ftp://x")
    with pytest.raises(ValueError, match="--worker-urls"):
        normalize_url(" ")
