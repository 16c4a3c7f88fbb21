"""A jump's forced tokens extended in the first pass of the next continuous decode launch
(``scheduler.steps.lead``), against the fake model that reads its KV (test_jump_forward_overlap):
every sampled token must still be the model's answer to its whole context, so a lead pass that
wrote a slot wrong, or decode steps that started from the wrong position, shows in the output."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tests.unit.test_jump_forward_overlap import (
    FORCED,
    PROMPTS,
    add,
    check_output,
    harness,
    random_traffic,
    run_prompts,
)


def lead_harness(*, overlap: bool, steps: int, rows: int = 32, tokens: int = 16, **kw):
    h = harness(overlap=overlap, steps=steps, on_device=True, **kw)
    h.s.cfg = dataclasses.replace(h.s.cfg, jump_overlap=False, jump_lead_rows=rows, jump_lead_tokens=tokens)
    h.s.kinds = h.s._step_kinds()
    return h


def launches(h) -> list[tuple[str, int, int]]:
    """Every launch as (kind, rows, steps), recorded through ``Scheduler.launch``."""
    seen: list[tuple[str, int, int]] = []
    launch = h.s.launch

    def record(batch, vocab_mask=None):
        seen.append((type(batch.kind).__name__, len(batch.reqs), batch.decode_steps))
        return launch(batch, vocab_mask)

    h.s.launch = record
    return seen


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("steps", [2, 4, 8])
def test_lead_launches_carry_the_jumps_and_keep_every_token_the_models(overlap, steps):
    h = lead_harness(overlap=overlap, steps=steps)
    seen = launches(h)
    run_prompts(h)
    leads = [x for x in seen if x[0] == "JumpLeadStep"]
    assert leads and h.s.stats.jump_lead_launches == len(leads)
    # after the prompts, jumped rows never get an extend pass of their own
    first_decode = next(i for i, x in enumerate(seen) if x[0] != "PrefillStep")
    assert all(x[0] != "PrefillStep" for x in seen[first_decode:])
    assert h.s.stats.jump_stale_tokens == 0


def test_the_decode_pace_times_a_lead_launchs_decode_steps_only():
    """A lead launch's first pass is an extend: its output's step time covers the decode steps
    behind it, and every plain decode launch is timed whole; prefills are not timed."""
    h = lead_harness(overlap=False, steps=4)
    submitted = []
    submit = h.s.worker.submit

    def record(fi, future_ids):
        fut = submit(fi, future_ids)
        submitted.append((fi, fut))
        return fut

    h.s.worker.submit = record
    for i, p in enumerate(PROMPTS):
        add(h, f"r{i}", p, 40)
    h.run()
    kinds = set()
    for fi, fut in submitted:
        took = fut.result().step_time
        if fi.then is not None:  # a lead launch
            kinds.add("lead")
            assert took is not None and took.steps == fi.then.decode_steps
        elif fi.mode.name == "DECODE":
            kinds.add("decode")
            assert took is not None and took.steps == fi.decode_steps
        else:
            assert took is None
    assert kinds == {"lead", "decode"}


def test_a_forced_run_longer_than_the_lead_shape_takes_the_prefill_step():
    """Rows whose forced run does not fit ``jump_lead_tokens`` extend in a pass of their own."""
    h = lead_harness(overlap=False, steps=4, tokens=len(FORCED))  # the run plus the kept token: 5
    seen = launches(h)
    for i, p in enumerate(PROMPTS):
        add(h, f"r{i}", p, 40)
    h.run()
    assert h.s.grammar.jumps > 0  # every jump extends 5 tokens: none fits a lead pass
    assert not any(x[0] == "JumpLeadStep" for x in seen) and h.s.stats.jump_lead_launches == 0
    for i, p in enumerate(PROMPTS):
        check_output(p, h.outputs()[f"r{i}"])


def test_a_lead_launch_waits_while_a_request_waits_for_admission():
    """Something waiting: the prefill step admits it and extends the jumped rows with it."""
    h = lead_harness(overlap=False, steps=4, max_running=2)
    seen = launches(h)
    for i, p in enumerate(PROMPTS):
        add(h, f"r{i}", p, 24)
    h.run()
    out = h.outputs()
    for i, p in enumerate(PROMPTS):
        assert len(out[f"r{i}"]) == 24
        check_output(p, out[f"r{i}"])
    assert any(x[0] == "JumpLeadStep" for x in seen)


@pytest.mark.parametrize("pool", [500, 1500])
@pytest.mark.parametrize("overlap", [False, True])
def test_random_traffic_with_lead_launches_keeps_outputs_and_the_pool(overlap, pool):
    """Arrivals while rows jump, chunked prompts, aborts, and (the small pool) requests that wait
    for memory and retractions: every output stays the model's own and every slot comes back
    (``Harness.run`` checks the pool). With the small pool something always waits, so the
    jumped rows take the prefill step."""
    h = lead_harness(overlap=overlap, steps=4, pool=pool, chunk=24, max_running=24)
    seen = launches(h)
    random_traffic(h, random.Random(11), abort_every=7)
    assert any(x[0] == "JumpLeadStep" for x in seen) == (pool > 500)
