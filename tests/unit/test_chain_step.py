"""Chain decode launches in the scheduler loop (``scheduler/steps/chain.py``), against a fake
model that reads its KV and a fake grammar that forces a run of tokens.

The fake chain pass does what ``executor/chain_decode.py`` does on the device: each step, each
row takes its next positions' slots from the block the scheduler gave it, lists them in its
``req_to_token`` row, writes its last token and the forced tokens after it (at most ``W - 1``)
there, then "samples" from its whole KV (a hash of the tokens in its slots), or takes the next
forced token where the run goes on; a row whose position the launch leaves to the device (-1)
continues where its last chain launch left it. So a slot the scheduler gave twice, a position it
lost, or KV it freed under a row shows in the output, which must be token for token what one
token a step gives.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from phloem.runtime.forward_io import ForwardOutput
from phloem.runtime.scheduler.req import Req

from tests.unit.test_jump_forward_overlap import content_token
from tests.unit.test_scheduler_loop import FakeRunner, Harness

FORCED = [60, 61, 62, 63, 64, 65]  # the run after every content token divisible by 3
PROMPTS = [[5, 6, 7], [8, 9], [11, 12, 13, 14], [15]]


def forced_left(ids: list[int]) -> list[int]:
    """The forced tokens still due after the context ``ids``: the rest of a run that began after
    the last content token, when that token is divisible by 3."""
    tail = 0
    while tail < len(ids) and ids[len(ids) - 1 - tail] in FORCED:
        tail += 1
    last = ids[len(ids) - 1 - tail] if tail < len(ids) else None
    if last is None or last % 3 or tail >= len(FORCED):
        return []
    return FORCED[tail:]


def next_token(ids: list[int]) -> int:
    """One token a step: the forced one where a run is due, else the model's."""
    due = forced_left(ids)
    return due[0] if due else content_token(ids)


def reference(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(next_token(ids))
    return ids[len(prompt) :]


class ChainRunner(FakeRunner):
    """Plain passes write each new token into its slot and answer from the row's KV; chain passes
    walk the forced run first (see the module docstring)."""

    def __init__(self, pool_slots: int) -> None:
        super().__init__(pool_slots)
        self.kv_tok = torch.full((pool_slots,), -1, dtype=torch.int64)
        self.req_to_token: torch.Tensor | None = None
        self.chain_launches = 0
        self.row_pos: dict[int, int] = {}  # the device's position of each request-pool row
        self.continued = 0  # rows that continued from the device's position

    def forward(self, fi) -> ForwardOutput:
        assert self.req_to_token is not None
        self.kv_tok[fi.out_slots] = fi.input_ids
        super().forward(fi)  # slot checks
        toks = [
            next_token(self.kv_tok[self.req_to_token[row, :n]].tolist())
            for row, n in zip(fi.req_pool_indices.tolist(), fi.seq_lens.tolist())
        ]
        t = torch.tensor(toks, dtype=torch.int64)
        return ForwardOutput(next_token_ids=t, next_token_ids_cpu=t.clone())

    def forward_chain(self, fi) -> ForwardOutput:
        assert self.req_to_token is not None
        steps, bs, w = fi.decode_steps, fi.batch_size, fi.chain_width
        tokens = torch.full((steps, bs, w), -1, dtype=torch.int64)
        counts = torch.zeros((steps, bs), dtype=torch.int64)
        cur = fi.input_ids.tolist()
        rows = fi.req_pool_indices.tolist()
        pos = [p if p >= 0 else self.row_pos[row] for p, row in zip(fi.positions.tolist(), rows)]
        self.continued += sum(p < 0 for p in fi.positions.tolist())
        start = list(pos)
        assert fi.chain_slots is not None and fi.chain_slots.shape == (bs, steps * w)
        for j in range(steps):
            for b, row in enumerate(rows):
                p = pos[b]
                ctx = self.kv_tok[self.req_to_token[row, :p]].tolist() + [cur[b]]
                chain = forced_left(ctx)[: w - 1]
                nodes = [cur[b], *chain]
                slots = fi.chain_slots[b, p - start[b] : p - start[b] + len(nodes)]
                assert len(slots) == len(nodes) and (slots > 0).all(), "a chain position without a slot"
                self.req_to_token[row, p : p + len(nodes)] = slots
                self.kv_tok[slots] = torch.tensor(nodes)
                y = next_token(self.kv_tok[self.req_to_token[row, : p + len(nodes)]].tolist())
                tokens[j, b, : len(chain)] = torch.tensor(chain, dtype=torch.int64)
                tokens[j, b, len(chain)] = y
                counts[j, b] = len(nodes)
                cur[b], pos[b] = y, p + len(nodes)
        for b, row in enumerate(rows):
            self.row_pos[row] = pos[b]
        self.chain_launches += 1
        last = torch.tensor(cur, dtype=torch.int64)
        return ForwardOutput(next_token_ids=last, next_token_ids_cpu=last.clone(), chain=(tokens, counts))


class DeviceGrammar:
    """Every row "on the device": it decodes ahead, and a chain launch gets its automaton rows."""

    def __init__(self) -> None:
        self.pending: list[Req] = []
        self.stop_token_ids: list[int] = []

    def add(self, req: Req) -> None:
        self.pending.append(req)

    def ready(self, scheduler) -> list[Req]:
        out, self.pending = self.pending, []
        for req in out:
            req.grammar = _Matcher()
            req.automaton = object()
        return out

    def accept(self, req: Req, token: int) -> None:
        req.grammar.accepted += 1

    def jump_forward(self, req: Req, *, first_mutable: int) -> tuple[int, list[int]]:
        raise AssertionError("a row on the device never jumps on the host under chain launches")

    def tokens_to_end(self, req: Req) -> None:
        return None

    def shortest_output(self, req: Req) -> None:
        return None

    def tokens_left_at_most(self, req: Req) -> None:
        return None

    def fill_mask(self, reqs: list[Req]) -> None:
        return None

    def automaton_rows(
        self, reqs: list[Req], discard: list[bool]
    ) -> tuple[object, torch.Tensor, torch.Tensor]:
        n = len(reqs)
        return object(), torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)

    def take_compile_times(self) -> list[float]:
        return []


class _Matcher:
    def __init__(self) -> None:
        self.accepted = 0

    def is_terminated(self) -> bool:
        return False


def chain_harness(*, overlap: bool, steps: int, width: int, pool: int = 4096) -> Harness:
    runner = ChainRunner(pool + 1)
    h = Harness(pool=pool, overlap=overlap, decode_steps=steps, runner=runner, radix=False)
    runner.req_to_token = h.rows.req_to_token
    h.s.cfg = dataclasses.replace(
        h.s.cfg, enable_jump_forward=True, jump_chain_width=width, jump_chain_rows=16
    )
    h.s.kinds = h.s._step_kinds()
    h.s.grammar = DeviceGrammar()
    return h


def add(h: Harness, rid: str, prompt: list[int], max_new: int) -> Req:
    return h.add(rid, prompt, max_new, json_schema='{"type": "string"}')


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("steps", "width"), [(1, 8), (4, 3), (8, 8), (3, 2)])
def test_chain_launches_give_one_token_a_steps_output(overlap, steps, width):
    h = chain_harness(overlap=overlap, steps=steps, width=width)
    budgets = [40, 17, 33, 5]
    for i, (p, n) in enumerate(zip(PROMPTS, budgets)):
        add(h, f"r{i}", p, n)
    h.run()
    out = h.outputs()
    for i, (p, n) in enumerate(zip(PROMPTS, budgets)):
        assert out[f"r{i}"] == reference(p, n), f"r{i}"  # cut at max_new_tokens, mid-run or not
    assert h.runner.chain_launches > 0 and h.s.stats.chain_launches == h.runner.chain_launches
    assert h.s.stats.chain_forced_tokens > 0
    assert h.cache.available_size == 4096  # every slot given ahead came back
    # under overlap a chain launch starts behind the one in flight, from the device's positions
    assert (h.runner.continued > 0) == overlap


def test_a_chain_launch_takes_fewer_steps_than_tokens():
    h = chain_harness(overlap=False, steps=4, width=8)
    add(h, "r", [6], 60)  # 6 is divisible by 3: a forced run at once
    h.run()
    assert h.outputs()["r"] == reference([6], 60)
    assert h.s.stats.continuous_decode_steps < 60 - 1
    # chain launches time the decode pace (a budgeted launch's steps follow it; 1 step until timed)
    assert h.s.pace.per_step is not None


@pytest.mark.parametrize(("value", "jump_forward", "want"), [
    ("-1", True, -1), ("0", True, 0), ("6", True, 6), ("8", False, 0),
])  # fmt: skip
def test_the_chain_width_switch(monkeypatch, value, jump_forward, want):
    """``PHLOEM_JUMP_CHAIN``: -1 leaves the width to the runner's device, 0 turns chains off, and
    without jump-forward there are none."""
    from phloem.runtime.config import EngineArgs
    from phloem.runtime.scheduler.builder import chain_width

    monkeypatch.setenv("PHLOEM_JUMP_CHAIN", value)
    assert chain_width(EngineArgs(enable_jump_forward=jump_forward)) == want


@pytest.mark.parametrize("value", ["1", "-3"])
def test_a_chain_width_that_means_nothing_is_refused_by_name(monkeypatch, value):
    from phloem.runtime.config import EngineArgs
    from phloem.runtime.scheduler.builder import chain_width

    monkeypatch.setenv("PHLOEM_JUMP_CHAIN", value)
    with pytest.raises(ValueError, match="PHLOEM_JUMP_CHAIN"):
        chain_width(EngineArgs(enable_jump_forward=True))
