"""``phloem doctor``'s rules on recorded gauge snapshots: each fires on the evidence that should
trigger it, and not otherwise."""

from __future__ import annotations

from phloem.bench.doctor import histogram_buckets, quantile, with_flags
from phloem.bench.doctor_rules import (
    RULES,
    Snapshot,
    chunked_prefill,
    cuda_graphs,
    diagnose,
    format_findings,
    memory,
    prompt_order,
    retractions,
    schedule_policy,
    suggested_flags,
    throughput,
)

CPU = {"device": "cpu", "max_total_num_tokens": 32768, "max_running_requests": 48, "chunked_prefill_size": 512,
       "enable_mixed_chunk": False, "schedule_policy": "fcfs", "cuda_graph_max_bs": 256}  # fmt: skip
CUDA = CPU | {"device": "cuda:0", "available_mem_gb": 20.0, "mem_fraction_static": 0.8}


def live(running: float = 1, queue: float = 0, usage: float = 0.1) -> dict[str, float]:
    return {"num_running_reqs": running, "num_queue_reqs": queue, "token_usage": usage}


def healthy(config: dict | None = None, **kw) -> Snapshot:
    """A run with nothing to change: a few requests, no queue, a roomy pool, steady latency."""
    base = dict(
        config=config or CPU,
        samples=[live(4, 0, 0.2)] * 8,
        counters={"prompt_tokens_total": 1000.0, "cached_tokens_total": 100.0},
        latency={"ttft_p50": 0.1, "ttft_p99": 0.2, "itl_p50": 0.02, "itl_p99": 0.03},
        requests=16,
    )
    return Snapshot(**(base | kw))


def test_a_healthy_run_changes_nothing() -> None:
    for config in (CPU, CUDA):
        findings = diagnose(healthy(config))
        assert [f.rule for f in findings] == [r.__name__ for r in RULES]
        assert not any(f.fired for f in findings), format_findings(findings)
        assert suggested_flags(findings) == {}


def test_memory_fires_when_the_pool_is_full_while_requests_wait() -> None:
    full = [live(8, 3, 0.95)] * 6 + [live(8, 0, 0.5)] * 2
    f = memory(healthy(samples=full))
    assert f.fired and f.flag == "--max-total-tokens" and f.value == "65536"
    f = memory(healthy(CUDA, samples=full))
    assert f.fired and (f.flag, f.value) == ("--mem-fraction-static", "0.85") and "20.0 GB" in f.evidence
    # full but nobody waits: the pool is used well, not too small
    assert not memory(healthy(samples=[live(8, 0, 0.95)] * 8)).fired
    # one burst of arrivals is not a sustained shortage
    assert not memory(healthy(samples=[live(8, 3, 0.95)] + [live(8, 0, 0.5)] * 7)).fired
    # retractions at a full pool are
    assert memory(healthy(samples=[live(8, 0, 0.95)], counters={"num_retracted_reqs_total": 2.0})).fired


def test_throughput_fires_at_the_running_cap_with_a_queue_and_room_in_the_pool() -> None:
    capped = CPU | {"max_running_requests": 1}
    f = throughput(healthy(capped, samples=[live(1, 5, 0.05)] * 8))
    assert f.fired and (f.flag, f.value) == ("--max-running-requests", "6")
    assert "max_running_requests 1" in f.evidence
    assert not throughput(healthy(capped, samples=[live(1, 5, 0.8)] * 8)).fired  # the pool is the limit
    assert not throughput(healthy(capped, samples=[live(1, 0, 0.05)] * 8)).fired  # nobody waits
    burst = [live(1, 5, 0.05)] + [live(1, 0, 0.05)] * 7
    assert not throughput(healthy(capped, samples=burst)).fired
    # a request being prefilled is not counted as running: the queue behind it still counts
    assert throughput(healthy(capped, samples=[live(0, 3, 0.05)] * 8)).fired
    # arrivals waiting for the next step under a roomy cap are no reason to raise it
    assert not throughput(healthy(samples=[live(0, 4, 0.05)] * 8)).fired


def test_retractions_fire_on_any_retraction() -> None:
    f = retractions(healthy(counters={"num_retracted_reqs_total": 3.0}))
    assert f.fired and (f.flag, f.value) == ("--max-running-requests", "24") and "3 retractions" in f.evidence
    assert not retractions(healthy()).fired


def test_cuda_graphs_fire_only_on_cuda_past_the_largest_graph() -> None:
    small = CUDA | {"cuda_graph_max_bs": 8}
    f = cuda_graphs(healthy(small, samples=[live(12, 0, 0.3)] * 4))
    assert f.fired and (f.flag, f.value) == ("--cuda-graph-max-bs", "16")
    assert not cuda_graphs(healthy(small, samples=[live(8, 0, 0.3)] * 4)).fired
    assert not cuda_graphs(healthy(CPU | {"cuda_graph_max_bs": 8}, samples=[live(12, 0, 0.3)] * 4)).fired


def test_chunked_prefill_fires_on_itl_spikes() -> None:
    spiky = {"ttft_p50": 0.5, "ttft_p99": 1.0, "itl_p50": 0.02, "itl_p99": 0.2}
    f = chunked_prefill(healthy(latency=spiky))
    assert f.fired and f.flag == "--enable-mixed-chunk" and f.value is None
    f = chunked_prefill(healthy(CPU | {"enable_mixed_chunk": True}, latency=spiky))
    assert f.fired and (f.flag, f.value) == ("--chunked-prefill-size", "256")
    assert not chunked_prefill(healthy(latency=spiky, requests=3)).fired  # too few samples


def test_prompt_order_fires_on_prefix_groups_that_lost_tokens() -> None:
    group = {"before": "Time: 10:00:0", "prompt_after": "2\nYou are", "cached_after": "1\nYou are",
             "count": 5, "tokens_lost": 400}  # fmt: skip
    f = prompt_order(healthy(prefix_groups=[group]))
    assert f.fired and "5 requests recomputed 400 tokens (40% of prompt tokens)" in f.evidence
    assert "'Time: 10:00:0'" in f.evidence and f.change == {}  # the fix is in the prompts, not a flag
    assert not prompt_order(healthy(prefix_groups=[group | {"tokens_lost": 0}])).fired


def test_schedule_policy_fires_on_shared_prefixes_with_a_moderate_queue() -> None:
    queued = [live(8, 20, 0.3)] * 8
    f = schedule_policy(healthy(samples=queued, shared_ceiling=0.6))
    assert f.fired and (f.flag, f.value) == ("--schedule-policy", "lpm")
    assert not schedule_policy(healthy(samples=queued, shared_ceiling=0.1)).fired  # little is shared
    assert not schedule_policy(
        healthy(samples=[live(8, 200, 0.3)] * 8, shared_ceiling=0.6)
    ).fired  # long queue
    assert not schedule_policy(healthy(samples=[live(8, 0, 0.3)] * 8, shared_ceiling=0.6)).fired  # no queue
    lpm = CPU | {"schedule_policy": "lpm"}
    assert not schedule_policy(healthy(lpm, samples=queued, shared_ceiling=0.6)).fired


def test_suggested_flags_keep_the_first_rule_and_apply_to_engine_flags() -> None:
    s = healthy(CPU | {"max_running_requests": 1}, samples=[live(1, 5, 0.05)] * 8, shared_ceiling=0.6,
                counters={"num_retracted_reqs_total": 1.0, "prompt_tokens_total": 10.0})  # fmt: skip
    changes = suggested_flags(diagnose(s))
    assert changes == {"--max-running-requests": "6", "--schedule-policy": "lpm"}
    engine = ["--max-running-requests", "1", "--enable-mixed-chunk", "--schedule-policy=fcfs"]
    assert with_flags(engine, changes) == [
        "--enable-mixed-chunk", "--max-running-requests", "6", "--schedule-policy", "lpm"
    ]  # fmt: skip
    assert with_flags([], {"--enable-mixed-chunk": None}) == ["--enable-mixed-chunk"]


def test_histogram_quantiles_from_two_scrapes() -> None:
    def body(counts: list[float]) -> str:
        bounds = ["0.1", "0.5", "1.0", "+Inf"]
        return "\n".join(
            f'phloem:time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} {c}'
            for le, c in zip(bounds, counts)
        )

    before = histogram_buckets(body([1, 1, 1, 1]))["time_to_first_token_seconds"]
    after = histogram_buckets(body([1, 5, 10, 11]))["time_to_first_token_seconds"]
    assert quantile(before, after, 0.5) == 1.0  # 10 new: 0 under 0.1, 4 under 0.5, 9 under 1.0
    assert quantile(before, after, 0.3) == 0.5
    assert quantile(before, after, 0.99) == 1.0  # past the last finite bound: that bound
    assert quantile(before, before, 0.5) == 0.0


def test_engine_flags_follow_the_double_dash_and_jsonl_workloads_load(tmp_path) -> None:
    import pytest
    from phloem.bench.doctor import load_requests, split_argv

    assert split_argv(["--dataset", "random", "--", "--max-running-requests", "1"]) == (
        ["--dataset", "random"], ["--max-running-requests", "1"]
    )  # fmt: skip
    assert split_argv(["--url", "http://x"]) == (["--url", "http://x"], [])
    path = tmp_path / "traffic.jsonl"
    path.write_text('{"text": "hello", "max_new_tokens": 3}\n\n{"prompt": "bye"}\n')
    sessions = load_requests(str(path), output_len=7)
    assert [(s.turns[0].content, s.turns[0].output_len) for s in sessions] == [("hello", 3), ("bye", 7)]
    path.write_text('{"messages": []}\n')
    with pytest.raises(ValueError, match="traffic.jsonl:1"):
        load_requests(str(path), output_len=7)


def test_shared_ceiling_counts_tokens_other_prompts_start_with() -> None:
    from phloem.bench.datasets import Session, Turn
    from phloem.bench.doctor import shared_ceiling

    class Words:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(w[0]) for w in text.split()]

    def one(text: str, sid: int) -> Session:
        return Session(sid=sid, turns=(Turn(content=text, output_len=1),))

    sessions = [one("a b c d", 0), one("a b c e", 1), one("x y", 2)]
    assert shared_ceiling(sessions, Words()) == 3 / 10
    assert shared_ceiling(sessions[:1], Words()) == 0.0
