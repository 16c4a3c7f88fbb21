"""Small pure pieces of the benchmark scripts: scaling, padding, timing maths, ratio tables."""

from __future__ import annotations

import pytest
from phloem.bench.client import Result
from phloem.bench.compare import ratio_table
from phloem.bench.one_batch import batch_timing
from phloem.bench.radix_shared_prefix import Workload, left_pad


def test_full_workload_is_the_documented_one():
    w = Workload()
    assert (w.num_requests, w.prefix_len, w.question_len, w.output_len, w.in_flight) == (64, 1024, 32, 64, 8)
    opt = w.dataset_options()
    assert (opt.num_groups, opt.prompts_per_group, opt.prefix_len) == (4, 16, 1024)


def test_scaled_workload_shrinks_and_keeps_floors():
    w = Workload.scaled(0.25)
    assert (w.num_requests, w.prefix_len, w.output_len, w.question_len, w.in_flight) == (16, 256, 16, 32, 8)
    tiny = Workload.scaled(0.01)
    assert (tiny.prompts_per_group, tiny.prefix_len, tiny.output_len) == (2, 64, 8)


def test_left_pad():
    ids, mask = left_pad([[1, 2, 3], [4]], pad=0)
    assert ids == [[1, 2, 3], [0, 0, 4]] and mask == [[1, 1, 1], [0, 0, 1]]


def test_batch_timing():
    rs = []
    for ttft, latency in [(0.5, 2.0), (1.0, 2.5)]:
        r = Result(0, 0, 10, 4, success=True)
        r.ttft, r.latency = ttft, latency
        rs.append(r)
    row = batch_timing(rs, batch=2, input_len=10, output_len=4)
    assert row["prefill_s"] == 1.0 and row["prefill_tok_s"] == 20.0
    assert row["decode_step_ms"] == pytest.approx(500.0) and row["decode_tok_s"] == pytest.approx(4.0)


def test_ratio_table_uses_medians():
    def rep(tput: float) -> dict:
        return {"output_throughput": tput, "mean_ttft_ms": 100.0, "failed": 0, "cache_hit_rate": None}

    text, ratios = ratio_table({"phloem": [rep(10), rep(30), rep(20)], "hf": [rep(5), rep(5)]}, "hf")
    assert ratios["output_throughput"]["ratio"] == 4.0
    assert ratios["mean_ttft_ms"]["ratio"] == 1.0 and ratios["cache_hit_rate"]["ratio"] is None
    assert "output tok/s" in text and "failed requests" in text


def test_spec_engine_reports_the_median_pass_and_accept_over_all_passes(monkeypatch):
    """``spec_engine._run`` against a fake engine: one warm-up, then ``repeats`` timed passes each
    after a cache flush; tok/s is the median pass, the accept length pools every verify."""
    from types import SimpleNamespace

    from phloem.bench.gpu import spec_engine

    clock = iter([0.0, 1.0, 10.0, 12.0, 20.0, 20.5])  # passes of 1 s, 2 s and 0.5 s
    monkeypatch.setattr(spec_engine, "time", SimpleNamespace(perf_counter=lambda: next(clock)))

    class FakeEngine:
        def __init__(self) -> None:
            self.calls: list[str] = []
            self.n = 0

        def flush_cache(self) -> None:
            self.calls.append("flush")

        def generate(self, prompts, sampling_params):  # noqa: ANN001
            self.calls.append("generate")
            self.n += 1
            accept = 2.0 if self.n % 2 else 3.0  # with 4 verifies on odd calls, 2 on even ones
            return [{"meta_info": {"completion_tokens": 10, "spec_accept_length": accept,
                                   "spec_verify_ct": 4 if self.n % 2 else 2},
                     "output_ids": [1, 2, 3]} for _ in prompts]  # fmt: skip

    eng = FakeEngine()
    r = spec_engine._run(eng, ["a", "b"], batch=2, max_new=4, repeats=3)
    assert eng.calls == ["generate", "flush", "generate", "flush", "generate", "flush", "generate"]
    assert r["tok_s_passes"] == [20.0, 10.0, 40.0] and r["tok_s"] == 20.0
    # the timed passes are generate calls 2, 3, 4: verify counts 2, 4, 2 with accept 3, 2, 3
    assert r["accept_length"] == pytest.approx((2 * 3 + 4 * 2 + 2 * 3) / (2 + 4 + 2))
    assert r["requests"] == 2 and r["ids"] == [[1, 2, 3], [1, 2, 3]]


def test_step_profile_counts_a_launch_of_k_steps_k_times(monkeypatch):
    """``step_profile.drive``: the per-decode-step median divides a scheduler step's wall time by
    the decode steps it delivered (two requests, four steps a launch, one second a launch)."""
    from types import SimpleNamespace

    from benchmarks.gpu import step_profile

    ticks = iter(range(1000))
    monkeypatch.setattr(
        step_profile,
        "time",
        SimpleNamespace(perf_counter=lambda: float(next(ticks)), thread_time=lambda: 0.0),
    )
    reqs = [SimpleNamespace(output_ids=[], finished=False) for _ in range(2)]

    def step():
        for r in reqs:
            r.output_ids.extend([0] * 4)
            r.finished = len(r.output_ids) >= 12

    out = step_profile.drive(SimpleNamespace(step=step, drain=lambda: None), reqs)
    assert out["steps"] == 3 and out["decode_tokens"] == 24
    assert out["step_wall_ms_median"] == 1000.0
    assert out["decode_step_ms_median"] == 250.0


def test_step_trace_records_what_each_step_launched(monkeypatch):
    """``step_profile --step-trace``: one row per step with its wall time, the launched batch's
    kind, rows, steps and extend lengths, and whether a short extend graph ran during it; the
    scheduler's own ``launch`` is back once the window closes."""
    from types import SimpleNamespace

    from benchmarks.gpu import step_profile

    clock = SimpleNamespace(now=0.0)  # this module's clock only (a collector pause may read it)
    monkeypatch.setattr(step_profile, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    graphs = SimpleNamespace(passes=0)

    class Sched:
        worker = SimpleNamespace(runner=SimpleNamespace(extend_graphs=graphs))

        def launch(self, batch, vocab_mask=None):
            return ("launched", batch.decode_steps)

    s = Sched()
    trace = step_profile.StepTrace(s)
    extend = SimpleNamespace(is_prefill=True, reqs=[1, 2], decode_steps=1, extend_lens=[5, 11])
    assert s.launch(extend) == ("launched", 1)
    graphs.passes += 1  # the extend replayed a graph
    clock.now = 0.002
    trace.stepped()
    decode = SimpleNamespace(is_prefill=False, reqs=[1, 2], decode_steps=6, extend_lens=[1, 1])
    s.launch(decode)
    clock.now = 0.010
    trace.stepped()
    clock.now = 0.011
    trace.stepped()  # nothing launched
    trace.close()
    assert trace.rows == [
        [2.0, "E", 2, 1, 11, 16, True],
        [8.0, "D", 2, 6, 1, 2, False],
        [1.0, "-", 0, 0, 0, 0, False],
    ]
    assert s.launch(decode) == ("launched", 6) and "launch" not in vars(s)


def test_jump_forward_ab_ratios_are_taken_within_each_round():
    """``jump_forward_ab.summarize``: each variant against ``base`` of the same round (a slow
    round slows both), the median of those ratios; a round without ``base`` has no ratio."""
    from phloem.bench.gpu.jump_forward_ab import summarize

    def row(variant, rnd, rps, batch=32):
        return {"variant": variant, "batch": batch, "round": rnd, "requests_per_s": rps}

    rows = [row("base", 0, 100.0), row("jf", 0, 130.0), row("base", 1, 50.0), row("jf", 1, 60.0),
            row("jf", 2, 500.0), row("base", 0, 10.0, batch=1), row("lead", 0, 14.0, batch=1)]  # fmt: skip
    out = summarize(rows)
    assert out["batch 32"]["jf"]["ratio_to_base"] == [1.3, 1.2, None]
    assert out["batch 32"]["jf"]["median_ratio"] == 1.25
    assert out["batch 32"]["base"]["median_ratio"] == 1.0
    assert out["batch 1"]["lead"] == {"requests_per_s": [14.0], "ratio_to_base": [1.4], "median_ratio": 1.4}


def test_jump_forward_ab_reads_the_launches_of_a_step_trace_and_builds_each_command():
    from phloem.bench.gpu.jump_forward_ab import command, launch_shape, row_of

    trace = [  # [wall_ms, kind, rows, decode_steps, longest_extend, extend_tokens, graph]
        [20.0, "E", 32, 1, 128, 4096, False],
        [5.0, "D", 32, 8, 1, 32, True],
        [6.0, "D", 32, 7, 9, 120, True],  # a lead launch: jumped rows extend 9 tokens
        [5.0, "D", 16, 8, 1, 16, True],
    ]
    assert launch_shape(trace) == {"decode_launches": 3, "lead_launches": 1, "steps_per_launch": {"7": 1, "8": 2}}
    timing = {"requests_per_s": 300.123, "chars_per_s": 5e4, "tok_s": 2e4, "decode_tokens": 2000, "steps": 4,
              "jump_forward_tokens": 900, "jump_stale_tokens": 0, "grammar_rejected": 0, "finish_kinds": ["stop"],
              "step_trace": trace}  # fmt: skip
    row = row_of("lead", 32, 1, {"timing": timing})
    assert row["requests_per_s"] == 300.12 and row["lead_launches"] == 1
    cmd = command("lead", 32, ["--decode-steps", "8"], "o.json")
    assert cmd[cmd.index("--batch") + 1] == "32" and cmd[cmd.index("--repeats") + 1] == "3"
    assert "--jump-forward" in cmd and cmd.index("--decode-steps") > cmd.index("--step-trace")
    assert "--load-format" in cmd and "--load-format" not in command("base", 1, [], "o.json", dummy=False)
    assert "--jump-forward" not in command("base", 1, [], "o.json")
