"""Split launches under jump-forward (``SchedulerConfig.jump_split``, ``steps.decode.live_rows``):
with overlap, each decode launch takes only rows with no launch in flight, at most half of them,
so a launch that may jump stays in flight while the other half's is built. Against the fake model
that reads its KV (test_jump_forward_overlap): every sampled token must still be the model's
answer to its whole context, and no launch may hold a row that has one in flight."""

from __future__ import annotations

import dataclasses
import random

import pytest
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import StopChecker
from phloem.runtime.scheduler.req import Req

from tests.unit.test_jump_forward_overlap import PROMPTS, harness, random_traffic, run_prompts
from tests.unit.test_scheduler_loop import EOS


def split_harness(*, steps: int, lead: bool = True, **kw):
    h = harness(overlap=True, steps=steps, on_device=True, **kw)
    lead_shape = {"jump_lead_rows": 32, "jump_lead_tokens": 16} if lead else {}
    h.s.cfg = dataclasses.replace(h.s.cfg, jump_overlap=False, jump_split=True, **lead_shape)
    h.s.kinds = h.s._step_kinds()
    return h


def watch(h) -> dict[str, list]:
    """Every launch's kind and rows, checking at launch time that none of its rows has a launch
    in flight; and how many launches were kept in flight behind another."""
    seen: dict[str, list] = {"launches": [], "overlapped": []}
    launch = h.s.launch

    def record(batch, vocab_mask=None):
        busy = [r.rid for r in batch.reqs if r.pending_outputs]
        assert not busy, f"{type(batch.kind).__name__} launched rows with a launch in flight: {busy}"
        seen["launches"].append((type(batch.kind).__name__, [r.rid for r in batch.reqs]))
        seen["overlapped"].append(len(h.s.inflight))  # launches in flight as this one goes
        return launch(batch, vocab_mask)

    h.s.launch = record
    return seen


@pytest.mark.parametrize("lead", [True, False])
@pytest.mark.parametrize("steps", [1, 2, 4, 8])
def test_split_launches_alternate_halves_and_keep_every_token_the_models(steps, lead):
    h = split_harness(steps=steps, lead=lead)
    seen = watch(h)
    run_prompts(h)
    assert h.s.stats.jump_stale_tokens == 0  # no launch was thrown away
    decodes = [rows for kind, rows in seen["launches"] if kind != "PrefillStep"]
    assert max(map(len, decodes)) <= (len(PROMPTS) + 1) // 2 + (len(PROMPTS) if lead else 0)
    assert any(n for n in seen["overlapped"])  # launches went out while another was in flight
    assert h.s.stats.jump_split_overlaps > 0 and h.s.live_stats()["jump_split_overlaps_total"] > 0
    if lead and steps > 1:  # lead launches are continuous decode launches
        assert h.s.stats.jump_lead_launches > 0


def test_without_a_constrained_row_the_launches_take_every_row():
    """Split applies only while a row may jump: unconstrained rows decode all together, in
    flight behind each other as usual."""
    h = split_harness(steps=4)
    sizes = []
    launch = h.s.launch

    def record(batch, vocab_mask=None):
        sizes.append((type(batch.kind).__name__, len(batch.reqs)))
        return launch(batch, vocab_mask)

    h.s.launch = record
    for i, p in enumerate(PROMPTS):
        params = SamplingParams(max_new_tokens=20, temperature=0.0)
        stop = StopChecker(params, eos_token_ids={EOS})
        h.s.add_request(Req(rid=f"r{i}", origin_input_ids=p, params=params, stop_checker=stop))
    h.run()
    decodes = [n for kind, n in sizes if kind != "PrefillStep"]
    assert decodes and max(decodes) == len(PROMPTS)
    assert all(len(o) == 20 for o in h.outputs().values())


@pytest.mark.parametrize(("pool", "mixed"), [(4096, False), (1500, True), (500, False)])
def test_random_traffic_with_split_launches_keeps_outputs_and_the_pool(pool, mixed):
    """Arrivals between steps, chunked prompts, aborts, decode rows riding in prefill passes
    (mixed), and (the small pool) requests waiting for room and rows retracted: outputs stay the
    model's own, no launch holds a row in flight, and the pool comes back whole."""
    h = split_harness(steps=4, pool=pool, chunk=24, max_running=24, mixed=mixed)
    seen = watch(h)
    random_traffic(h, random.Random(5), abort_every=6)
    assert any(n for n in seen["overlapped"])
