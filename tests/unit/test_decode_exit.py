"""Early exit of continuous decode (``executor/decode_exit.py``): the stop flags' reference, which
rows carry which stop ids (``policy.device_stop_ids``), and the scheduler loop with a fake runner
that runs continuous batches as the decode graphs do with early exit: once every row of a launch
has sampled a stop token, its later steps compute nothing (no KV written) and return garbage.
Outputs must not change, and the steps the host would have thrown away are skipped."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from phloem.runtime.executor.decode_exit import DecodeExit, stop_flags_reference
from phloem.runtime.forward_io import ForwardMode, ForwardOutput, decode_step_input
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import StopChecker
from phloem.runtime.scheduler.policy import device_stop_ids, stop_rows
from phloem.runtime.scheduler.req import Req

from tests.unit.test_continuous_decode import FeedRunner
from tests.unit.test_scheduler_loop import EOS, Harness, expected, token_after

GARBAGE = 5  # what a skipped step "samples": never a token the fake model gives (10..59)


def test_reference_marks_stopped_rows_with_their_tag_and_clears_go_when_all_stopped() -> None:
    done = torch.zeros(8, dtype=torch.int64)
    rows, tags = torch.tensor([3, 6]), torch.tensor([11, 12])
    stops = torch.tensor([[1, 7], [1, -1]])
    assert stop_flags_reference(done, rows, tags, stops, None)  # nothing stopped yet
    assert stop_flags_reference(done, rows, tags, stops, torch.tensor([7, 4]))  # row 3 stops
    assert done.tolist() == [0, 0, 0, 11, 0, 0, 0, 0]
    assert stop_flags_reference(done, rows, tags, stops, torch.tensor([9, -1]))  # -1 only pads
    assert not stop_flags_reference(done, rows, tags, stops, torch.tensor([9, 1]))  # both stopped
    assert done[6] == 12
    # a later request in row 3 has another tag: the old mark does not count for it
    assert stop_flags_reference(done, torch.tensor([3]), torch.tensor([13]), stops[:1], None)


def test_decode_exit_counts_only_steps_that_follow() -> None:
    exit = DecodeExit(4, torch.device("cpu"))
    rows, tags, stops = torch.tensor([1]), torch.tensor([5]), torch.tensor([[EOS]])
    exit.update(rows, tags, stops)
    assert bool(exit.go) and exit.skipped == 0
    exit.update(rows, tags, stops, torch.tensor([EOS]))  # the stop: the next step skips
    assert not bool(exit.go) and exit.skipped == 1
    exit.update(rows, tags, stops, torch.tensor([GARBAGE]), step_follows=False)  # the launch's last
    assert not bool(exit.go) and exit.skipped == 1
    exit.update(rows, tags, stops)  # the next launch, queued before the host saw the stop
    assert not bool(exit.go) and exit.skipped == 2
    exit.open()
    assert bool(exit.go)
    with pytest.raises(ValueError):
        exit.update(rows[:0], tags[:0], stops[:0])


def _req(**kw) -> Req:
    params = SamplingParams(max_new_tokens=50, temperature=0.0, **kw)
    return Req(
        rid="r", origin_input_ids=[1, 2], params=params, stop_checker=StopChecker(params, eos_token_ids={2})
    )


def test_device_stop_ids_are_the_tokens_that_certainly_end_the_request() -> None:
    assert device_stop_ids(_req()) == {2}
    assert device_stop_ids(_req(stop_token_ids=[9])) == {2, 9}
    assert device_stop_ids(_req(ignore_eos=True, stop_token_ids=[9])) == {9}
    assert device_stop_ids(_req(ignore_eos=True)) == frozenset()
    floor = _req(min_new_tokens=3)
    assert device_stop_ids(floor) == frozenset()  # a stop before the floor does not end it
    floor.output_ids = [7, 7, 7]
    assert device_stop_ids(floor) == {2}
    under_grammar = _req(ignore_eos=True)
    under_grammar.grammar = object()  # the grammar's stop tokens end it: terminated or refused
    assert device_stop_ids(under_grammar, grammar_stops=[2, 3]) == {2, 3}
    under_grammar.params = SamplingParams(max_new_tokens=50, min_new_tokens=1, ignore_eos=True)
    under_grammar.output_ids = [7, 7]
    assert device_stop_ids(under_grammar, grammar_stops=[2]) == frozenset()


def test_stop_rows_pad_to_the_widest_row_and_carry_tags() -> None:
    a, b, c = _req(stop_token_ids=[9, 4]), _req(), _req(ignore_eos=True)
    ids, tags = stop_rows([a, b, c])
    assert ids == [[2, 4, 9], [2, -1, -1], [-1, -1, -1]]
    assert tags == [a.stop_tag, b.stop_tag, c.stop_tag] and len(set(tags)) == 3
    assert stop_rows([c]) == ([[-1]], [c.stop_tag])


class ExitRunner(FeedRunner):
    """``forward_steps`` as the decode graphs run it with early exit (FeedRunner checks that every
    step it computes reads the token sampled before it, so a garbage token fed on fails)."""

    def __init__(self, pool_slots: int, pool_rows: int) -> None:
        super().__init__(pool_slots)
        self.exit = DecodeExit(pool_rows, torch.device("cpu"))
        self.carried = 0  # launches that carried stop ids

    def forward_steps(self, fi) -> ForwardOutput:
        assert fi.mode == ForwardMode.DECODE
        tags, stop_ids = fi.sampling.stop_tags, fi.sampling.stop_ids
        stops = (tags, stop_ids) if tags is not None else None
        rows = fi.req_pool_indices
        if stops is not None:
            self.carried += 1
            self.exit.update(rows, *stops)
        else:
            self.exit.open()
        ids, steps = fi.input_ids, []
        for j in range(fi.decode_steps):
            if bool(self.exit.go):
                tokens = self.forward(decode_step_input(fi, j, ids)).next_token_ids
            else:
                tokens = torch.full_like(ids, GARBAGE)  # nothing computed, no KV written
            if stops is not None:
                self.exit.update(rows, *stops, tokens, step_follows=j + 1 < fi.decode_steps)
            steps.append(ForwardOutput(next_token_ids=tokens, next_token_ids_cpu=tokens.clone()))
            ids = tokens
        last = steps[-1]
        return ForwardOutput(next_token_ids=last.next_token_ids, next_token_ids_cpu=last.next_token_ids_cpu,
                             steps=steps)  # fmt: skip


def harness(*, overlap: bool, steps: int = 8, early_exit: bool = True, pool: int = 4096, **kw) -> Harness:
    max_running = kw.pop("max_running", 16)
    runner = ExitRunner(pool + 1, max_running)
    h = Harness(pool=pool, overlap=overlap, decode_steps=steps, runner=runner, max_running=max_running, **kw)
    h.s.cfg = dataclasses.replace(h.s.cfg, decode_early_exit=early_exit)
    return h


@pytest.mark.parametrize("overlap", [False, True])
def test_a_stop_inside_a_launch_skips_the_rest_and_the_next_launch(overlap):
    h = harness(overlap=overlap)
    third = token_after(10 - 1 + 2)
    h.add("stop", list(range(100, 110)), max_new=40, stop_token_ids=[third])
    h.run()  # also checks that every slot came back
    assert h.outputs()["stop"] == expected(10, 3)
    assert h.finished()["stop"] == {"type": "stop", "matched": third}
    assert h.runner.carried > 0
    # the stop is the third token: the first token came from the prefill, the stop from step 1 of
    # the first launch, so its steps 2..7 skip, and with overlap the whole next launch too
    assert h.runner.exit.skipped == (6 + 8 if overlap else 6)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_batch_skips_only_once_every_row_stopped(overlap):
    h = harness(overlap=overlap)
    early, late = token_after(10 - 1 + 2), token_after(20 - 1 + 12)
    h.add("early", list(range(100, 110)), max_new=40, stop_token_ids=[early])
    h.add("late", list(range(300, 320)), max_new=40, stop_token_ids=[late])
    h.add("free", list(range(500, 530)), max_new=18, ignore_eos=True)  # ends by length: no stop ids
    h.run()
    out = h.outputs()
    assert (
        out["early"] == expected(10, 3)
        and out["late"] == expected(20, 13)
        and out["free"] == expected(30, 18)
    )
    assert h.runner.exit.skipped == 0  # the free row never stops on the device


def test_rows_without_stop_ids_never_skip_and_early_exit_off_carries_nothing():
    h = harness(overlap=True, early_exit=False)
    h.add("stop", list(range(100, 110)), max_new=40, stop_token_ids=[token_after(11)])
    h.run()
    assert h.outputs()["stop"] == expected(10, 3)
    assert h.runner.carried == 0 and h.runner.exit.skipped == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_random_traffic_with_stops_gives_the_outputs_without_early_exit(overlap):
    """Requests arriving between steps, stop tokens at random places, min_new_tokens floors,
    aborts and a small pool (retraction): the same outputs and finish reasons with early exit
    as without it, and steps were skipped."""

    def traffic(early_exit: bool) -> tuple[dict, dict, int]:
        rng = random.Random(3)
        h = harness(overlap=overlap, steps=4, early_exit=early_exit, pool=600, chunk=32, max_running=8)
        for i in range(40):
            n = rng.randint(3, 40)
            start = 1000 + 60 * i
            stop_at = rng.randint(0, 30)
            stops = [token_after(n - 1 + stop_at)] if rng.random() < 0.7 else []
            kw = {"min_new_tokens": rng.randint(1, 6)} if rng.random() < 0.2 else {}
            h.add(
                f"r{i}", list(range(start, start + n)), max_new=rng.randint(1, 40), stop_token_ids=stops, **kw
            )
            for _ in range(rng.choice([0, 1, 3, 12])):  # sometimes long enough for a batch to end
                h.s.step()
            if rng.random() < 0.1:
                h.s.abort(f"r{rng.randint(0, i)}", message="test abort")
        h.run()
        return h.outputs(), h.finished(), h.runner.exit.skipped

    out, fin, skipped = traffic(True)
    assert (out, fin) == traffic(False)[:2]
    assert skipped > 0
    assert any(f["type"] == "stop" for f in fin.values())


class _Matcher:
    def accept_token(self, token: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False


class EndGrammar:
    """The scheduler's ``Grammar`` protocol for rows whose grammar is on the device and knows the
    fewest tokens left to their end: here exactly the tokens before the row's stop token."""

    stop_token_ids = [EOS]

    def __init__(self, ends: dict[str, int]) -> None:
        self.pending: list[Req] = []
        self.ends = ends  # rid -> output length at which the row's stop token comes

    def add(self, req: Req) -> None:
        self.pending.append(req)

    def ready(self, scheduler) -> list[Req]:
        out, self.pending = self.pending, []
        for req in out:
            req.grammar, req.automaton = _Matcher(), object()  # on the device: decodes ahead
        return out

    def accept(self, req: Req, token: int) -> None:
        pass

    def jump_forward(self, req: Req, *, first_mutable: int) -> tuple[int, list[int]]:
        return 0, []

    def fill_mask(self, reqs: list[Req]) -> None:
        return None

    def tokens_to_end(self, req: Req) -> int | None:
        return self.ends[req.rid] - len(req.output_ids)

    def shortest_output(self, req: Req) -> int:
        return 24

    def tokens_left_at_most(self, req: Req) -> None:
        return None  # unbounded: launches are not cut short

    def automaton_rows(self, reqs: list[Req], discard: list[bool]) -> None:
        return None

    def take_compile_times(self) -> list[float]:
        return []


class BoundedGrammar(EndGrammar):
    """Also knows the most tokens left: exactly those before the row's stop token, and the stop."""

    def tokens_left_at_most(self, req: Req) -> int:
        return self.ends[req.rid] - len(req.output_ids)


def _computed_steps(
    *, near_end_sync: bool, early_exit: bool = False, bounded: bool = False
) -> tuple[int, list[int]]:
    """Decode rows computed for two grammar rows that stop after 11 and 13 tokens, 8 steps a
    launch, with overlap; and the outputs."""
    runner = FeedRunner(4097)
    h = Harness(pool=4096, overlap=True, decode_steps=8, runner=runner)
    ends = {"a": 11, "b": 13}
    known = ends if near_end_sync or bounded else {"a": 10**6, "b": 10**6}
    h.s.grammar = (BoundedGrammar if bounded else EndGrammar)(known)
    h.s.cfg = dataclasses.replace(h.s.cfg, sync_near_end=near_end_sync)
    h.s.cfg = dataclasses.replace(h.s.cfg, decode_early_exit=early_exit)
    for rid, n in (("a", 10), ("b", 20)):
        stop = token_after(n - 1 + ends[rid] - 1)
        params = SamplingParams(max_new_tokens=60, temperature=0.0, json_schema="{}", stop_token_ids=[stop])
        req = Req(rid=rid, origin_input_ids=list(range(100, 100 + n)), params=params,
                  stop_checker=StopChecker(params, eos_token_ids={EOS}))  # fmt: skip
        h.s.add_request(req)
    h.run()
    out = h.outputs()
    assert out == {"a": expected(10, 11), "b": expected(20, 13)}
    return runner.decode_inputs, out


def test_a_batch_that_may_end_is_processed_before_the_next_launch():
    """With every row within reach of its end, the launch is processed at once, so no launch of
    8 steps is queued behind it for rows that ended: 16 rows fewer computed here. With early
    exit the device skips such steps instead, and the batch stays in flight."""
    synced, _ = _computed_steps(near_end_sync=True)
    overlapped, _ = _computed_steps(near_end_sync=False)
    assert overlapped - synced == 16
    assert _computed_steps(near_end_sync=True, early_exit=True)[0] == overlapped


def test_no_step_is_launched_past_the_most_tokens_a_grammar_allows():
    """A grammar on the device that bounds the tokens left (``Scheduler._output_cap``) ends the
    batch's launches where its last row has certainly ended: with an exact bound the two rows
    compute the 12 decode steps of the longer one (the shorter rides along, as a launch is not
    cut for one row), where the overlap loop alone computes whole launches behind the end."""
    capped, out = _computed_steps(near_end_sync=False, bounded=True)
    assert capped == 2 * (13 - 1)
    assert _computed_steps(near_end_sync=False)[0] > capped + 8


def test_a_grammar_that_may_always_end_waits_only_a_few_times():
    """A row whose grammar could end after any token (a regex ending in ``.*``) would be processed
    at once every launch: each request counts as near its end at most ``NEAR_END_SYNCS`` times."""
    from phloem.runtime.scheduler.scheduler import NEAR_END_SYNCS

    class AlwaysNear(EndGrammar):
        def tokens_to_end(self, req: Req) -> int:
            return 1

    runner = FeedRunner(4097)
    h = Harness(pool=4096, overlap=True, decode_steps=8, runner=runner)
    h.s.grammar = AlwaysNear({})
    params = SamplingParams(max_new_tokens=60, temperature=0.0, json_schema="{}")
    req = Req(rid="a", origin_input_ids=list(range(100, 110)), params=params,
              stop_checker=StopChecker(params, eos_token_ids={EOS}))  # fmt: skip
    h.s.add_request(req)
    h.run()
    assert h.outputs()["a"] == expected(10, 60)
    assert req.near_end_syncs == NEAR_END_SYNCS == h.s.stats.near_end_syncs


def test_a_grammar_with_a_short_shortest_output_never_waits():
    """A grammar that may end after a couple of tokens (most regexes) has no end of its own to be
    near: its batches stay in flight."""

    class Short(EndGrammar):
        def shortest_output(self, req: Req) -> int:
            return 3

    runner = FeedRunner(4097)
    h = Harness(pool=4096, overlap=True, decode_steps=8, runner=runner)
    h.s.grammar = Short({"a": 11})
    params = SamplingParams(
        max_new_tokens=60, temperature=0.0, json_schema="{}", stop_token_ids=[token_after(19)]
    )
    h.s.add_request(Req(rid="a", origin_input_ids=list(range(100, 110)), params=params,
                        stop_checker=StopChecker(params, eos_token_ids={EOS})))  # fmt: skip
    h.run()
    assert h.outputs()["a"] == expected(10, 11) and h.s.stats.near_end_syncs == 0


def test_an_output_cap_ends_a_rows_steps_as_max_new_tokens_does():
    params = SamplingParams(max_new_tokens=50, temperature=0.0, json_schema="{}")
    stop = StopChecker(params, eos_token_ids={EOS})
    req = Req(rid="a", origin_input_ids=[1, 2, 3], params=params, stop_checker=stop)
    req.output_ids = [5] * 10
    assert req.steps_left_at_most == 40 and req.wants_token  # no cap: the budget
    req.output_cap = 14
    assert req.steps_left_at_most == 4 and req.remaining_new_tokens == 40
    req.pending_outputs = 4  # a launch in flight reaches the cap: the row needs no further step
    assert req.steps_left_at_most == 0 and not req.wants_token
    req.output_cap = 60  # past the budget: the budget ends it
    assert req.steps_left_at_most == 36
