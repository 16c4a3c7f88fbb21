"""Continuous decode (``--num-continuous-decode-steps``): several decode steps launched as one
batch, each feeding its tokens to the next without the host. Scheduler loop with the position
model of ``test_scheduler_loop``, whose runner here also checks that every decode step reads the
token the step before it sampled."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from phloem.runtime.forward_io import ForwardMode, ForwardOutput
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import StopChecker
from phloem.runtime.scheduler.batch import write_decode_slots
from phloem.runtime.scheduler.policy import decodes_ahead
from phloem.runtime.scheduler.req import Req

from tests.unit.test_scheduler_loop import EOS, FakeRunner, Harness, expected, random_traffic, token_after


class FeedRunner(FakeRunner):
    """A decode step's input must be the token sampled after the position before it."""

    def __init__(self, pool_slots: int) -> None:
        super().__init__(pool_slots)
        self.decode_inputs = 0

    def forward(self, fi) -> ForwardOutput:
        if fi.mode == ForwardMode.DECODE:
            want = torch.tensor([token_after(int(p) - 1) for p in fi.positions])
            assert torch.equal(fi.input_ids, want), (fi.input_ids, want)
            self.decode_inputs += fi.batch_size
        return super().forward(fi)


def harness(*, steps: int, overlap: bool, pool: int = 4096, **kw) -> tuple[Harness, list[int]]:
    """A harness whose worker records each launched batch's step count."""
    h = Harness(pool=pool, overlap=overlap, decode_steps=steps, runner=FeedRunner(pool + 1), **kw)
    launched: list[int] = []
    submit = h.s.worker.submit

    def record(fi, future_ids):
        if fi.mode == ForwardMode.DECODE:
            launched.append(fi.decode_steps)
        return submit(fi, future_ids)

    h.s.worker.submit = record
    return h, launched


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("steps", [2, 4, 8])
def test_outputs_equal_single_steps_and_max_new_tokens_holds(overlap, steps):
    h, launched = harness(steps=steps, overlap=overlap)
    lens, max_new = [5, 17, 40, 3], [12, 7, 30, 1]
    for i, (n, m) in enumerate(zip(lens, max_new)):
        h.add(f"r{i}", list(range(100 + i, 100 + i + n)), max_new=m)
    h.run()
    out = h.outputs()
    for i, (n, m) in enumerate(zip(lens, max_new)):
        assert out[f"r{i}"] == expected(n, m)
    assert all(f["type"] == "length" for f in h.finished().values())
    assert max(launched) == steps  # batches of several steps ran...
    assert h.runner.decode_inputs == sum(max_new) - len(lens)  # ...and no token was computed twice


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_token_inside_a_batch_drops_the_tokens_after_it(overlap):
    h, launched = harness(steps=8, overlap=overlap, pool=1024)
    third = token_after(10 - 1 + 2)
    h.add("stop", list(range(100, 110)), max_new=20, stop_token_ids=[third])
    h.run()  # also checks that every slot of the dropped tokens came back
    assert h.outputs()["stop"] == expected(10, 3)
    assert h.finished()["stop"] == {"type": "stop", "matched": third}
    assert 8 in launched


def test_rows_that_need_the_host_every_step_keep_single_steps():
    h, launched = harness(steps=4, overlap=False)
    h.add("plain", list(range(100, 110)), max_new=10)
    h.add("lp", list(range(200, 210)), max_new=10, ignore_eos=True)
    h.s.waiting[-1].return_logprob = True
    h.run()
    assert h.outputs()["plain"] == expected(10, 10)
    assert set(launched) == {1}


def test_waiting_requests_are_admitted_between_batches():
    h, launched = harness(steps=4, overlap=False)
    h.add("a", list(range(100, 110)), max_new=20)
    h.s.step()  # prefill of a
    h.s.step()  # a decodes 4 steps at once
    assert launched == [4]
    h.add("b", list(range(300, 320)), max_new=6)
    h.s.step()  # b is admitted now, not after a's remaining steps
    assert h.s.waiting == [] and len(h.s.running) == 2
    h.run()
    assert h.outputs()["a"] == expected(10, 20)
    assert h.outputs()["b"] == expected(20, 6)


def test_small_pool_falls_back_to_single_steps_and_everyone_finishes():
    h, launched = harness(steps=8, overlap=True, pool=300, max_running=16)
    reqs = [h.add(f"r{i}", list(range(1000 + 50 * i, 1000 + 50 * i + 30)), max_new=60) for i in range(8)]
    h.run()
    out = h.outputs()
    for r in reqs:
        assert out[r.rid] == expected(30, 60), r.rid
    assert 1 in launched and 8 in launched


@pytest.mark.parametrize("overlap", [False, True])
def test_random_requests_and_aborts_keep_the_pool_invariant(overlap):
    h, launched = harness(steps=4, overlap=overlap, pool=512, chunk=32, max_running=8)

    def ids(rng: random.Random) -> list[int]:
        return [rng.randint(10, 60) for _ in range(rng.randint(1, 40))]

    random_traffic(h, random.Random(1), ids, max_steps_between=6)
    assert 4 in launched


def _req(**kw) -> Req:
    params = SamplingParams(max_new_tokens=16, **kw)
    return Req(
        rid="r", origin_input_ids=[5, 6], params=params, stop_checker=StopChecker(params, eos_token_ids={EOS})
    )


def test_decodes_ahead_excludes_what_the_host_reads_per_step():
    assert decodes_ahead(_req())
    assert decodes_ahead(_req(temperature=0.8, top_p=0.9, top_k=20, stop_token_ids=[9]))
    assert not decodes_ahead(_req(frequency_penalty=0.5))
    assert not decodes_ahead(_req(presence_penalty=0.5))
    assert not decodes_ahead(_req(repetition_penalty=1.1))
    assert not decodes_ahead(_req(sampling_seed=3))
    banned = _req(min_new_tokens=2)
    assert not decodes_ahead(banned)
    banned.output_ids = [7, 8]
    assert decodes_ahead(banned)
    lp = _req()
    lp.return_logprob = True
    assert not decodes_ahead(lp)


class _Row:
    def __init__(self, row: int, kv_len: int) -> None:
        self.req_pool_idx, self.kv_len = row, kv_len


def test_write_decode_slots_fills_every_step_of_every_row():
    table = torch.zeros(4, 16, dtype=torch.int64)
    reqs = [_Row(1, 3), _Row(3, 7)]
    slots = torch.tensor([11, 12, 13, 21, 22, 23])  # row after row, three steps each
    index = write_decode_slots(table, reqs, slots, steps=3)
    assert table[1, 3:6].tolist() == [11, 12, 13] and table[3, 7:10].tolist() == [21, 22, 23]
    assert table.count_nonzero() == 6
    assert index.tolist() == [[1, 3], [3, 7], [11, 21], [4, 8], [1, 1]]


def test_a_budget_sets_the_steps_from_the_measured_step_time():
    """With a budget the steps per launch follow the step time: a device clock that moves 1 ms
    per forward step and a 3.5 ms budget give launches of 3 steps once one step was timed, where
    the cap alone would give 8; tokens as with single steps."""
    h, launched = harness(steps=8, overlap=False, decode_budget_s=3.5e-3)
    h.s.worker.timer.clock = lambda: h.runner.steps * 1e-3
    h.add("a", list(range(100, 110)), max_new=30)
    h.run()
    assert h.outputs()["a"] == expected(10, 30)
    # the first launch times a step (nothing measured yet); then 3 steps each, and a shorter last one
    assert launched[0] == 1
    assert set(launched[1:-1]) == {3} and launched[-1] <= 3
    assert h.s.pace.per_step == pytest.approx(1e-3)
    assert h.s.live_stats()["decode_step_ms"] == pytest.approx(1.0)


def test_a_slow_step_keeps_single_steps_and_neither_prefills_nor_host_work_count_as_decode():
    h, launched = harness(steps=8, overlap=False, decode_budget_s=3.5e-3)
    h.s.worker.timer.clock = lambda: h.runner.steps * 5e-3  # 5 ms a step: over the budget
    h.add("a", list(range(100, 110)), max_new=12)
    h.s.step()  # the prefill: not a decode step
    assert h.s.pace.per_step is None
    h.s.step()  # a decode launch: its step timed
    assert h.s.pace.per_step == pytest.approx(5e-3)
    h.run()
    assert h.outputs()["a"] == expected(10, 12)
    assert set(launched) == {1}
    assert h.s.pace.per_step == pytest.approx(5e-3)


def test_a_fixed_cost_per_launch_does_not_shorten_the_launches():
    """Host work around each launch (here 10 ms, more than the budget) is not a step's: with
    1 ms steps and a 4.5 ms budget every launch after the first carries 4 steps."""
    h, launched = harness(steps=8, overlap=False, decode_budget_s=4.5e-3)
    host = {"ms": 0.0}
    h.s.worker.timer.clock = lambda: h.runner.steps * 1e-3 + host["ms"] * 1e-3
    submit = h.s.worker.submit

    def slow_host(fi, future_ids):
        host["ms"] += 10.0  # a launch's build and hand-off, outside its steps
        return submit(fi, future_ids)

    h.s.worker.submit = slow_host
    h.add("a", list(range(100, 110)), max_new=40)
    h.run()
    assert h.outputs()["a"] == expected(10, 40)
    assert launched[0] == 1 and set(launched[1:-1]) == {4}


def test_a_logged_launch_names_its_step_count(caplog):
    import dataclasses
    import logging

    h, launched = harness(steps=4, overlap=False)
    h.s.cfg = dataclasses.replace(h.s.cfg, log_interval=1)
    h.add("a", list(range(100, 110)), max_new=13)
    with caplog.at_level(logging.INFO, logger="phloem.scheduler"):
        h.run()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch")]
    assert launched == [4, 4, 4] and len(lines) == 3
    assert all(line.endswith(", #steps: 4") for line in lines)


def test_staged_step_rows_are_what_each_step_reads():
    """The one staged block of a graph-replayed batch (``stage_step_rows``) holds, for every
    step, the positions, slots, rows and lengths that ``decode_step_input`` gives that step, and
    padding rows (padding slot, one key) after the batch."""
    from phloem.runtime.cache.kv_pool import PADDING_SLOT
    from phloem.runtime.executor.cuda_graph import stage_step_rows
    from phloem.runtime.executor.model_runner import greedy_sampling_info
    from phloem.runtime.forward_io import ForwardInput, decode_step_input

    steps, bs, padded = 3, 2, 4
    kv = torch.tensor([5, 9])
    fi = ForwardInput(
        mode=ForwardMode.DECODE, input_ids=torch.tensor([7, 8]), positions=kv.clone(),
        out_slots=torch.tensor([40, 50]), req_pool_indices=torch.tensor([2, 0]), seq_lens=kv + 1,
        prefix_lens=kv.clone(), extend_lens=torch.ones(bs, dtype=torch.int64),
        sampling=greedy_sampling_info(bs), decode_steps=steps,
        step_slots=torch.tensor([[40, 50], [41, 51], [42, 52]]),
    )  # fmt: skip
    block = np.full((steps, 4, 6), -7, dtype=np.int64)
    stage_step_rows(block, fi, padded)
    for j in range(steps):
        step = decode_step_input(fi, j, fi.input_ids)
        want = [step.positions, step.out_slots, step.req_pool_indices, step.seq_lens]
        assert block[j, :, :bs].tolist() == [t.tolist() for t in want]
        assert block[j, :, bs:padded].T.tolist() == [[0, PADDING_SLOT, 0, 1]] * (padded - bs)
    assert (block[:, :, padded:] == -7).all()  # columns past the padded batch untouched
