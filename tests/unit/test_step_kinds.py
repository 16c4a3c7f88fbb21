"""Dispatch by step kind: each kind schedules, launches and processes its own batches, and the
scheduler asks the kinds in a fixed order."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from phloem.runtime.forward_io import ForwardMode
from phloem.runtime.scheduler.batch import ScheduledBatch
from phloem.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
from phloem.runtime.scheduler.steps.continuous import ContinuousDecodeStep
from phloem.runtime.scheduler.steps.decode import DecodeStep
from phloem.runtime.scheduler.steps.prefill import PrefillStep
from phloem.runtime.scheduler.steps.spec_step import SpecStep
from phloem.runtime.scheduler.steps.spec_window import SpecWindowStep

from tests.unit.test_continuous_decode import FeedRunner
from tests.unit.test_scheduler_loop import Harness, expected


def _record_kinds(s: Scheduler) -> list[tuple[str, str, int]]:
    """Wrap every kind of ``s``: log (call, kind, batch id) for each schedule, launch and process."""
    log: list[tuple[str, str, int]] = []
    for kind in s.kinds:
        name = type(kind).__name__

        def wrap(kind=kind, name=name):
            schedule, launch, process = kind.schedule, kind.launch, kind.process

            def scheduled():
                batch = schedule()
                if batch is not None:
                    assert batch.kind is kind, "a kind's batch carries that kind"
                    log.append(("schedule", name, id(batch)))
                return batch

            def launched(batch, mask):
                log.append(("launch", name, id(batch)))
                return launch(batch, mask)

            def processed(batch, fut):
                log.append(("process", name, id(batch)))
                return process(batch, fut)

            kind.schedule, kind.launch, kind.process = scheduled, launched, processed

        wrap()
    return log


def _each_batch_stays_with_its_kind(log: list[tuple[str, str, int]]) -> set[str]:
    by_batch: dict[int, list[tuple[str, str]]] = {}
    for call, name, batch in log:
        by_batch.setdefault(batch, []).append((call, name))
    for calls in by_batch.values():
        # ids may be reused once a batch is gone: check each schedule/launch/process triple
        for i in range(0, len(calls), 3):
            triple = calls[i : i + 3]
            assert [c for c, _ in triple] == ["schedule", "launch", "process"]
            assert len({n for _, n in triple}) == 1
    return {name for _, name, _ in log}


@pytest.mark.parametrize("overlap", [False, True])
def test_prefill_and_decode_kinds_run_their_own_batches(overlap):
    h = Harness(pool=4096, overlap=overlap, chunk=16)
    assert [type(k) for k in h.s.kinds] == [PrefillStep, DecodeStep]
    log = _record_kinds(h.s)
    h.add("long", list(range(200, 240)), max_new=6)
    h.add("short", list(range(300, 305)), max_new=6)
    h.run()
    assert _each_batch_stays_with_its_kind(log) == {"PrefillStep", "DecodeStep"}
    assert h.outputs()["long"] == expected(40, 6)
    assert h.outputs()["short"] == expected(5, 6)


@pytest.mark.parametrize("overlap", [False, True])
def test_continuous_decode_is_its_own_kind(overlap):
    h = Harness(pool=4096, overlap=overlap, decode_steps=4, runner=FeedRunner(4097))
    assert [type(k) for k in h.s.kinds] == [PrefillStep, ContinuousDecodeStep, DecodeStep]
    log = _record_kinds(h.s)
    for i in range(3):
        h.add(f"r{i}", list(range(100 + i, 110 + i)), max_new=9)
    h.run()
    kinds = _each_batch_stays_with_its_kind(log)
    assert {"PrefillStep", "ContinuousDecodeStep"} <= kinds
    for i in range(3):
        assert h.outputs()[f"r{i}"] == expected(10, 9)


def test_the_first_kind_with_a_batch_is_launched_and_processed_by_that_kind():
    h = Harness(pool=4096, overlap=False)
    calls: list[str] = []

    class Stub:
        def __init__(self, name: str, has_batch: bool) -> None:
            self.name, self.has_batch = name, has_batch

        def schedule(self):
            calls.append(f"schedule {self.name}")
            return ScheduledBatch(mode=ForwardMode.DECODE, reqs=[], kind=self) if self.has_batch else None

        def launch(self, batch, mask):
            calls.append(f"launch {self.name}")
            fut: Future = Future()
            fut.set_result(None)
            return fut

        def process(self, batch, fut):
            calls.append(f"process {self.name}")

    h.s.kinds = [Stub("a", False), Stub("b", True), Stub("c", True)]
    assert h.s.step()
    assert calls == ["schedule a", "schedule b", "launch b", "process b"]


class _FakeSpec:
    """Enough of a speculative step for the scheduler to choose kinds: nothing is eligible."""

    max_tree = 4
    needs_hidden = False
    needs_context = True
    window = None
    mean_accept_length = 0.0

    @staticmethod
    def eligible(params, *, wants_logprobs, num_outputs):
        return False

    def release(self, row):
        pass

    def on_prefill_done(self, row, fill_ids, first_token):
        pass

    def on_plain_steps(self, rows, tokens, hidden_rows):
        pass


def test_speculative_kinds_decline_ineligible_rows_and_plain_decode_runs():
    h = Harness(pool=4096, overlap=False, decode_steps=4)
    s = Scheduler(h.s.cfg.__class__(**{**h.s.cfg.__dict__, "overlap": False}), cache=h.cache, req_pool=h.rows,
                  worker=h.s.worker, sampling=h.s.sampling, outputs=h.s.outputs, spec=_FakeSpec())
    assert [type(k) for k in s.kinds] == [PrefillStep, SpecWindowStep, SpecStep, DecodeStep]
    h.s = s
    log = _record_kinds(s)
    h.add("a", list(range(100, 108)), max_new=5)
    h.run()
    assert _each_batch_stays_with_its_kind(log) == {"PrefillStep", "DecodeStep"}
    assert h.outputs()["a"] == expected(8, 5)


def test_speculative_decoding_needs_the_non_overlap_loop():
    cfg = SchedulerConfig(max_running_requests=4, max_prefill_tokens=64, chunked_prefill_size=None, overlap=True)
    h = Harness(pool=64, overlap=True)
    with pytest.raises(ValueError):
        Scheduler(cfg, cache=h.cache, req_pool=h.rows, worker=h.s.worker, sampling=h.s.sampling,
                  outputs=h.s.outputs, spec=_FakeSpec())
