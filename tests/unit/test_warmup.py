"""The start-up warm-up: its plan, when it runs, and that it leaves the scheduler as it found it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from phloem.runtime.config import EngineArgs
from phloem.runtime.scheduler.warmup import WarmupLimits, plan_warmup, run_warmup, use_warmup

LIMITS = WarmupLimits(
    vocab_size=1000, context_len=4096, pool_tokens=1 << 20, max_running=256,
    max_prefill_tokens=16384, chunked_prefill_size=16384, decode_steps=1,
)  # fmt: skip


def test_use_warmup_auto_means_cuda_and_never_with_a_storage_tier():
    assert use_warmup("auto", "cuda") and not use_warmup("auto", "cpu")
    assert use_warmup("on", "cpu") and not use_warmup("off", "cuda")
    assert not use_warmup("on", "cuda", storage_tier=True)


def test_plan_fills_one_pass_and_spills_into_the_next():
    short, full, extended = plan_warmup(LIMITS)
    assert len(short) == 1 and len(short[0].input_ids) == 5 and short[0].return_logprob
    total = sum(len(r.input_ids) for r in full)
    assert 16384 + 16384 // 4 <= total < 16384 + 16384 // 4 + 16384 // 4  # the last prompt is chunked
    assert all(len(r.input_ids) <= 16384 // 4 for r in full)
    assert {r.params.temperature for r in full} == {0.0, 0.7, 1.0}  # greedy and sampled rows together
    assert all(0 <= t < 1000 for w in (short, full, extended) for r in w for t in r.input_ids)
    assert all(
        r.params.ignore_eos and r.params.max_new_tokens == 3 for w in (short, full, extended) for r in w
    )


def test_plan_extends_cached_prefixes():
    _, full, extended = plan_warmup(LIMITS)
    assert len(extended) == (len(full) + 1) // 2
    for old, new in zip(full[::2], extended):
        keep = len(old.input_ids) * 3 // 4
        assert new.input_ids[:keep] == old.input_ids[:keep] and len(new.input_ids) > keep


def test_plan_respects_small_limits():
    tight = WarmupLimits(
        vocab_size=50, context_len=40, pool_tokens=400, max_running=3,
        max_prefill_tokens=16384, chunked_prefill_size=None, decode_steps=4,
    )  # fmt: skip
    waves = plan_warmup(tight)
    reqs = [r for w in waves for r in w]
    assert all(len(r.input_ids) + r.params.max_new_tokens < 40 for r in reqs)  # context
    assert len(waves[1]) <= 2  # max_running - 1
    assert sum(len(r.input_ids) for r in waves[1]) <= 400 // 4 + 40  # a quarter of the pool, roughly
    assert reqs[0].params.max_new_tokens == 9  # two continuous launches and the prefill's token
    assert plan_warmup(WarmupLimits(50, 8, 400, 3, 16384, None, 4)) == []  # context too short


def test_plan_is_deterministic_per_seed():
    assert plan_warmup(LIMITS, seed=3) == plan_warmup(LIMITS, seed=3) != plan_warmup(LIMITS, seed=4)


def _scheduler(**kw):
    from phloem.runtime.scheduler.builder import build_scheduler

    sent: list = []
    args = EngineArgs(load_format="dummy", device="cpu", max_total_tokens=4096, max_running_requests=8, **kw)
    scheduler, rt = build_scheduler(args, send=sent.append)
    return scheduler, rt, sent


def _limits(scheduler, rt):
    return WarmupLimits(
        vocab_size=rt.runner.vocab_size, context_len=rt.info["context_length"],
        pool_tokens=rt.info["max_total_num_tokens"], max_running=scheduler.cfg.max_running_requests,
        max_prefill_tokens=scheduler.cfg.max_prefill_tokens, chunked_prefill_size=scheduler.cfg.chunked_prefill_size,
    )  # fmt: skip


def test_run_warmup_sends_nothing_and_leaves_the_scheduler_fresh():
    scheduler, rt, sent = _scheduler()
    rt.runner.sampler.generator(rt.runner.device).manual_seed(12345)  # stands for earlier draws
    waves = plan_warmup(_limits(scheduler, rt))
    summary = run_warmup(scheduler, rt, waves)
    assert summary["warmup_requests"] == sum(len(w) for w in waves) >= 3
    assert summary["warmup_prompt_tokens"] > scheduler.cfg.chunked_prefill_size  # more than one pass
    assert sent == []  # no output reached the detokenizer's channel
    stats = scheduler.live_stats()
    assert stats["available_tokens"] == stats["max_total_num_tokens"]  # flushed: no cached prefix
    assert stats["prompt_tokens_total"] == stats["cached_tokens_total"] == 0
    assert stats["new_token_ratio"] == scheduler.ratio.init
    assert scheduler.is_idle and not scheduler.running
    # the unseeded rows' generator starts over from the sampler's seed
    fresh = torch.Generator().manual_seed(rt.runner.sampler.seed)
    gen = rt.runner.sampler.generator(rt.runner.device)
    assert torch.equal(gen.get_state(), fresh.get_state())


def test_run_warmup_refuses_a_busy_scheduler():
    from phloem.runtime.sampling.params import SamplingParams
    from phloem.runtime.sampling.stop import StopChecker
    from phloem.runtime.scheduler.req import Req

    scheduler, rt, _ = _scheduler()
    p = SamplingParams(max_new_tokens=2)
    scheduler.add_request(Req(rid="x", origin_input_ids=[1, 2, 3], params=p, stop_checker=StopChecker(p)))
    with pytest.raises(RuntimeError, match="idle"):
        run_warmup(scheduler, rt, plan_warmup(_limits(scheduler, rt)))


def test_plan_adds_a_constrained_request_with_a_grammar_backend():
    short = plan_warmup(dataclasses.replace(LIMITS, grammar=True))[0]
    assert [r.params.grammar is not None for r in short] == [False, True]
    assert all(r.params.grammar is None for w in plan_warmup(LIMITS) for r in w)


def test_run_warmup_builds_the_grammar_backend_and_forgets_its_compile_times():
    scheduler, rt, sent = _scheduler()
    assert scheduler.grammar is not None and scheduler.grammar._manager is None  # built lazily
    summary = run_warmup(
        scheduler, rt, plan_warmup(dataclasses.replace(_limits(scheduler, rt), grammar=True))
    )
    assert summary["warmup_requests"] >= 4 and sent == []
    assert scheduler.grammar._manager is not None  # the first real constrained request finds it built
    assert scheduler.grammar.take_compile_times() == []  # the warm-up's compile is not a metric


def test_a_grammar_backend_that_fails_does_not_fail_the_warmup(monkeypatch, caplog):
    import phloem.grammars.registry as registry

    def broken(*a, **k):
        raise RuntimeError("no backend here")

    monkeypatch.setattr(registry, "create_backend", broken)
    scheduler, rt, _ = _scheduler()
    with caplog.at_level("WARNING", logger="phloem.scheduler"):
        summary = run_warmup(
            scheduler, rt, plan_warmup(dataclasses.replace(_limits(scheduler, rt), grammar=True))
        )
    assert summary["warmup_requests"] >= 4
    assert "constrained request failed" in caplog.text and "no backend here" in caplog.text
    stats = scheduler.live_stats()
    assert stats["available_tokens"] == stats["max_total_num_tokens"]


def _run_one(scheduler, params):
    from phloem.runtime.sampling.stop import StopChecker
    from phloem.runtime.scheduler.req import Req

    req = Req(rid="r", origin_input_ids=list(range(5, 40)), params=params, stop_checker=StopChecker(params))
    scheduler.add_request(req)
    while not scheduler.is_idle:
        scheduler.step()
    return req.output_ids


@pytest.mark.parametrize("spec", [None, "NGRAM", "EAGLE windows"])
def test_unseeded_sampling_after_the_warmup_equals_a_fresh_scheduler(spec):
    """The warm-up samples too; afterwards the unseeded generators (the sampler's and, with
    speculation, the acceptance sampler's or the windows') start over, so the first real samples
    are the ones a scheduler without a warm-up draws."""
    from phloem.runtime.sampling.params import SamplingParams

    params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    kw: dict = {"speculative_algorithm": spec} if spec else {}
    if spec == "EAGLE windows":
        kw = {"speculative_algorithm": "EAGLE", "num_continuous_decode_steps": 4}
    cold, _, _ = _scheduler(**kw)
    want = _run_one(cold, params)
    warm, rt, _ = _scheduler(**kw)
    run_warmup(warm, rt, plan_warmup(_limits(warm, rt)))
    assert _run_one(warm, params) == want and len(want) == 12


def test_speculative_reset_restarts_the_acceptance_sampler():
    scheduler, _, _ = _scheduler(speculative_algorithm="NGRAM")
    spec = scheduler.spec
    first = torch.rand(4, generator=spec.verifier.generator)
    torch.rand(4, generator=spec.verifier.generator)  # the warm-up's draws
    spec.verify_count, spec.accepted_tokens = 5, 9
    scheduler.reset_counters()
    assert torch.equal(torch.rand(4, generator=spec.verifier.generator), first)
    assert spec.mean_accept_length == 0.0


def test_speculative_reset_restarts_the_window_sampler():
    scheduler, _, _ = _scheduler(speculative_algorithm="EAGLE", num_continuous_decode_steps=4)
    window = scheduler.spec.window
    first = torch.rand(4, generator=window.generator)
    torch.rand(4, generator=window.generator)  # the warm-up's draws
    scheduler.reset_counters()
    assert torch.equal(torch.rand(4, generator=window.generator), first)
