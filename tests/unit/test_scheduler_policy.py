"""Admission, ordering, sibling deferral and retraction rules, without a model."""

from __future__ import annotations

import pytest
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import StopChecker
from phloem.runtime.scheduler.policy import (
    LPM_FALLBACK_QUEUE_LEN,
    NewTokenRatio,
    order_waiting,
    ratio_after_retraction,
    retraction_order,
    should_defer_sibling,
)
from phloem.runtime.scheduler.prefill_adder import AddResult, PrefillAdder, charged_future_tokens
from phloem.runtime.scheduler.req import Req


def make_req(rid: str, n_in: int, *, max_new: int = 16, out: int = 0, arrival: float = 0.0,
             priority: int = 0, ignore_eos: bool = False, ids: list[int] | None = None) -> Req:
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos)
    req = Req(
        rid=rid,
        origin_input_ids=ids if ids is not None else list(range(100, 100 + n_in)),
        params=params,
        stop_checker=StopChecker(params),
        priority=priority,
        arrival_time=arrival,
    )
    req.output_ids = [7] * out
    return req


class FakeMatch:
    def __init__(self, length: int) -> None:
        self.length = length


def with_prefix(req: Req, n: int) -> Req:
    req.match = FakeMatch(n)
    return req


# ---------------------------------------------------------------------------- PrefillAdder
def adder(available: int, running=(), *, ratio=0.5, max_prefill=1000, chunk=None, max_new_reqs=10) -> PrefillAdder:
    return PrefillAdder(
        available_tokens=available, running=list(running), new_token_ratio=ratio,
        max_prefill_tokens=max_prefill, chunk_size=chunk, max_new_reqs=max_new_reqs,
    )


def test_adder_budget_changes_only_through_its_methods():
    a = adder(100)
    a.charge(30)  # a prefix lock took slots out of the pool
    assert a.rem_total == 70 and a.covers(70) and not a.covers(71)
    a.credit(10)
    assert a.rem_total == 80
    assert a.add(make_req("big", 200, max_new=0)) == AddResult.NO_TOKEN
    a.lift_forecast()  # alone: any pass that fits is admitted
    assert a.add(make_req("big", 200, max_new=0)) == AddResult.ADDED
    with pytest.raises(AttributeError):
        a.rem_total = 5  # type: ignore[misc]


def test_adder_withdraw_undoes_an_admission_and_the_cut():
    a = adder(1000, chunk=50)
    r1, r2 = make_req("a", 20), make_req("b", 100)
    assert a.add(r1) == AddResult.ADDED and a.add(r2) == AddResult.ADDED
    assert a.new_chunked is r2 and not a.takes_tokens
    a.can_run.clear()  # a copy: the adder's own list is untouched
    assert a.can_run == [r1, r2]
    a.withdraw(r2)
    assert a.can_run == [r1] and a.new_chunked is None
    a.withdraw(r1)
    assert a.can_run == [] and a.new_chunked is None


def test_adder_charges_running_requests_by_ratio_and_ignore_eos_exactly():
    r1 = make_req("a", 10, max_new=100, out=20)  # 80 left x 0.5 = 40
    r1.kv_len = len(r1.fill_ids)
    r2 = make_req("b", 10, max_new=100, out=20, ignore_eos=True)  # exactly 80
    r2.kv_len = len(r2.fill_ids)
    assert charged_future_tokens(r1, 0.5) == pytest.approx(40)
    assert charged_future_tokens(r2, 0.5) == pytest.approx(80)
    a = adder(1000, [r1, r2])
    assert a.rem_total == pytest.approx(1000 - 120)


def test_adder_requires_full_remaining_max_new_tokens_for_new_request():
    a = adder(100)
    assert a.add(with_prefix(make_req("x", 50, max_new=60), 0)) == AddResult.NO_TOKEN
    assert a.add(with_prefix(make_req("y", 50, max_new=50), 0)) == AddResult.ADDED
    assert a.rem_total == 0


def test_adder_counts_cached_prefix_as_free():
    a = adder(100)
    req = with_prefix(make_req("x", 120, max_new=10), 60)
    assert a.add(req) == AddResult.ADDED
    assert req.extend_len == 60


def test_adder_chunks_only_the_last_request():
    a = adder(10_000, chunk=100)
    r1 = with_prefix(make_req("a", 60), 0)
    r2 = with_prefix(make_req("b", 80), 0)
    r3 = with_prefix(make_req("c", 10), 0)
    assert a.add(r1) == AddResult.ADDED and not r1.is_chunked and r1.extend_len == 60
    assert a.add(r2) == AddResult.ADDED and r2.is_chunked and r2.extend_len == 40
    assert a.new_chunked is r2
    assert a.add(r3) == AddResult.NO_ROOM  # chunk budget used up
    assert a.can_run == [r1, r2]


def test_adder_token_budget_and_request_cap():
    a = adder(10_000, max_prefill=100, max_new_reqs=2)
    assert a.add(with_prefix(make_req("a", 10), 0)) == AddResult.ADDED
    assert a.add(with_prefix(make_req("b", 10), 0)) == AddResult.ADDED
    assert a.add(with_prefix(make_req("c", 10), 0)) == AddResult.NO_ROOM


def test_request_not_allowed_to_chunk_runs_whole_only_when_alone():
    a = adder(10_000, chunk=50)
    big = with_prefix(make_req("big", 80), 0)
    assert a.add(big, allow_chunk=False) == AddResult.ADDED
    assert big.extend_len == 80 and not big.is_chunked
    b = adder(10_000, chunk=50)
    assert b.add(with_prefix(make_req("s", 10), 0)) == AddResult.ADDED
    assert b.add(with_prefix(make_req("big", 80), 0), allow_chunk=False) == AddResult.NO_ROOM


def test_chunk_continuation_is_not_charged_twice():
    req = make_req("c", 300, max_new=10)
    req.kv_len = 100
    a = adder(1000, [req], ratio=1.0, chunk=128)
    # charged for its unprocessed prompt (200) and remaining output (10)
    assert a.rem_total == pytest.approx(1000 - 210)
    a.add_chunked(req)
    assert req.extend_len == 128 and req.is_chunked
    assert a.rem_total == pytest.approx(1000 - 210)


# ---------------------------------------------------------------------------- ordering
def test_fcfs_orders_by_arrival():
    reqs = [make_req("b", 4, arrival=2), make_req("a", 4, arrival=1), make_req("c", 4, arrival=3)]
    assert [r.rid for r in order_waiting(reqs, policy="fcfs", prefix_len_of=lambda r: 0, use_priority=False)] == ["a", "b", "c"]


def test_lpm_orders_by_cached_prefix_then_arrival():
    reqs = [make_req("a", 4, arrival=1), make_req("b", 4, arrival=2), make_req("c", 4, arrival=3)]
    lens = {"a": 1, "b": 9, "c": 9}
    got = order_waiting(reqs, policy="lpm", prefix_len_of=lambda r: lens[r.rid], use_priority=False)
    assert [r.rid for r in got] == ["b", "c", "a"]


def test_lpm_falls_back_to_fcfs_on_long_queues():
    n = LPM_FALLBACK_QUEUE_LEN + 1
    reqs = [make_req(str(i), 4, arrival=i) for i in range(n)]
    calls = []
    got = order_waiting(reqs, policy="lpm", prefix_len_of=lambda r: calls.append(r) or -r.arrival_time, use_priority=False)
    assert [r.rid for r in got] == [str(i) for i in range(n)]
    assert not calls  # no matching at all above the limit


def test_priority_orders_levels_and_keeps_policy_within_a_level():
    reqs = [make_req("low", 4, arrival=0, priority=1), make_req("hi2", 4, arrival=2, priority=5),
            make_req("hi1", 4, arrival=1, priority=5)]
    got = order_waiting(reqs, policy="fcfs", prefix_len_of=lambda r: 0, use_priority=True)
    assert [r.rid for r in got] == ["hi1", "hi2", "low"]


# ---------------------------------------------------------------------------- siblings
def test_sibling_with_long_shared_uncached_prefix_is_deferred():
    stem = list(range(1000, 1040))  # 40 shared tokens
    first = make_req("a", 0, ids=stem + [1, 2])
    second = with_prefix(make_req("b", 0, ids=stem + [3, 4]), 0)
    assert should_defer_sibling(second, [first])


def test_sibling_deferral_ignores_cached_part_and_short_overlaps():
    stem = list(range(1000, 1040))
    first = make_req("a", 0, ids=stem + [1, 2])
    cached = with_prefix(make_req("b", 0, ids=stem + [3, 4]), 20)  # only 20 uncached shared
    assert not should_defer_sibling(cached, [first])
    short = with_prefix(make_req("c", 0, ids=stem[:31] + [9]), 0)
    assert not should_defer_sibling(short, [first])


# ---------------------------------------------------------------------------- retraction
def test_retraction_order_least_output_first_then_longer_input():
    a = make_req("a", 10, out=5)
    b = make_req("b", 30, out=1)
    c = make_req("c", 50, out=1)
    d = make_req("d", 5, out=9)
    assert [r.rid for r in retraction_order([a, b, c, d])] == ["c", "b", "a", "d"]


def test_ratio_after_retraction_formula_and_cap():
    rs = [make_req("a", 4, max_new=100, out=10), make_req("b", 4, max_new=100, out=30)]
    assert ratio_after_retraction(rs) == pytest.approx((40 + 20 * 2) / 200)
    assert ratio_after_retraction([make_req("c", 4, max_new=10, out=9)]) == 1.0


def test_new_token_ratio_decays_to_floor_in_about_600_steps_and_jumps():
    r = NewTokenRatio(1.0)
    assert r.value == pytest.approx(0.7)
    for _ in range(599):
        r.step()
    assert r.value > r.floor
    for _ in range(5):
        r.step()
    assert r.value == pytest.approx(r.floor)
    r.raise_to(0.9)
    assert r.value == pytest.approx(0.9)
    r.raise_to(5.0)
    assert r.value == 1.0


def test_continuous_decode_plan_resolves_auto_per_device():
    from phloem.runtime.scheduler.policy import (
        AUTO_DECODE_BUDGET_MS,
        AUTO_DECODE_STEPS,
        continuous_decode_plan,
    )

    auto_cuda = continuous_decode_plan(0, None, device_type="cuda", speculative=False)
    assert auto_cuda == (AUTO_DECODE_STEPS, AUTO_DECODE_BUDGET_MS / 1e3)
    assert continuous_decode_plan(0, None, device_type="cpu", speculative=False) == (1, 0.0)
    assert continuous_decode_plan(0, None, device_type="cuda", speculative=True) == (1, 0.0)
    assert continuous_decode_plan(0, 0.0, device_type="cuda", speculative=False) == (1, 0.0)  # budget 0: off
    assert continuous_decode_plan(0, 20.0, device_type="cpu", speculative=False) == (AUTO_DECODE_STEPS, 0.02)
    # an explicit count stays exact unless a budget is given too
    assert continuous_decode_plan(4, None, device_type="cuda", speculative=False) == (4, 0.0)
    assert continuous_decode_plan(4, 2.0, device_type="cuda", speculative=True) == (4, 0.002)


def test_decode_pace_averages_the_device_time_of_each_launchs_steps():
    from phloem.runtime.forward_io import StepTime
    from phloem.runtime.scheduler.policy import DecodePace

    pace = DecodePace()
    assert pace.steps_within(0.008, 8) == 1  # nothing measured yet
    pace.decode_processed(None)  # an untimed launch is no sample
    assert pace.per_step is None and pace.steps_within(0.008, 8) == 1
    pace.decode_processed(StepTime(1, lambda: 0.002))
    assert pace.per_step == pytest.approx(0.002)
    assert pace.steps_within(0.008, 8) == 4
    pace.decode_processed(StepTime(4, lambda: 0.004))  # 4 steps in 4 ms: 1 ms a step, averaged in
    assert pace.per_step == pytest.approx(0.002 + DecodePace.ALPHA * (0.001 - 0.002))
    before = pace.per_step
    pace.decode_processed(StepTime(0, lambda: 1.0))  # no steps timed (a lead launch of one pass)
    assert pace.per_step == before
    assert pace.steps_within(0.001, 8) == 1 and pace.steps_within(1.0, 8) == 8
    pace.decode_processed(StepTime(2, lambda: 0.0))  # faster than the clock resolves: the cap
    assert pace.steps_within(0.008, 8) >= 6


def test_step_timer_times_the_steps_queued_between_its_marks():
    from phloem.runtime.executor.step_timer import StepTimer

    now = [1.0]
    timer = StepTimer("cpu", clock=lambda: now[0])
    assert not timer.cuda
    mark = timer.start()
    now[0] = 1.006
    took = timer.stop(mark, 3)
    now[0] = 9.0  # reading later (after the tokens) does not move it
    assert took.steps == 3 and took.read() == pytest.approx(0.006)
