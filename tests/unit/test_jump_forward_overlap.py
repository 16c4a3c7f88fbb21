"""Jump-forward in the scheduler loop, with and without overlap, one step or several a launch.

The fake model here reads its KV: a row's next token is a hash of the tokens written to the slots
its ``req_to_token`` row lists, so KV that a jump should have dropped and recomputed, or a row
rewritten under a launch still reading it, changes the output. The fake grammar forces a run of
tokens (60..63, never sampled) after every sampled token divisible by 3, rewriting the newest
tokens as a real retokenization does. With overlap, a launch of a jumping request is then already
in flight; its tokens are stale and must be thrown away (``Req.stale_outputs``).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from phloem.runtime.forward_io import ForwardOutput
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import StopChecker
from phloem.runtime.scheduler.req import Req

from tests.unit.test_scheduler_loop import EOS, FakeRunner, Harness

FORCED = [60, 61, 62, 63]


def content_token(ids: list[int]) -> int:
    """The fake model's token after the context ``ids`` (10..59: never EOS, never forced)."""
    return 10 + sum((i + 1) * t for i, t in enumerate(ids)) % 50


class ContentRunner(FakeRunner):
    """Writes each new token into its slot, then answers from the row's whole KV."""

    def __init__(self, pool_slots: int) -> None:
        super().__init__(pool_slots)
        self.kv_tok = torch.zeros(pool_slots, dtype=torch.int64)
        self.req_to_token: torch.Tensor | None = None

    def forward(self, fi) -> ForwardOutput:
        assert self.req_to_token is not None
        self.kv_tok[fi.out_slots] = fi.input_ids
        toks = []
        for row, n in zip(fi.req_pool_indices.tolist(), fi.seq_lens.tolist()):
            toks.append(content_token(self.kv_tok[self.req_to_token[row, :n]].tolist()))
        super().forward(fi)  # slot checks
        t = torch.tensor(toks, dtype=torch.int64)
        return ForwardOutput(next_token_ids=t, next_token_ids_cpu=t.clone())


class ForcingMatcher:
    def __init__(self) -> None:
        self.accepted = 0

    def accept_token(self, token: int) -> bool:
        self.accepted += 1
        return True

    def is_terminated(self) -> bool:
        return False


class ForcingGrammar:
    """The scheduler's ``Grammar`` protocol over ``ForcingMatcher``; ``on_device`` lets rows decode
    several steps a launch (a grammar on the device needs no host mask)."""

    def __init__(self, *, on_device: bool) -> None:
        self.pending: list[Req] = []
        self.on_device = on_device
        self.jumps = 0
        self.stop_token_ids = [EOS]

    def add(self, req: Req) -> None:
        self.pending.append(req)

    def ready(self, scheduler) -> list[Req]:
        out, self.pending = self.pending, []
        for req in out:
            req.grammar = ForcingMatcher()
            req.automaton = object() if self.on_device else None
        return out

    def accept(self, req: Req, token: int) -> None:
        assert token < FORCED[0], "a stale token reached the grammar"
        req.grammar.accept_token(token)

    def jump_forward(self, req: Req, *, first_mutable: int) -> tuple[int, list[int]]:
        out = req.output_ids
        if out[-1] >= FORCED[0] or out[-1] % 3:
            return 0, []
        drop = min(2, len(out) - first_mutable)  # rewrite up to two tokens, as retokenizing may
        new_ids = [*out[len(out) - drop :][:1], *FORCED]  # the first dropped token survives
        budget = req.params.max_new_tokens - len(out)
        if len(new_ids) - drop > budget:
            if drop:
                return 0, []  # a cut rewrite could spell less than it replaces: decode instead
            new_ids = new_ids[:budget]
        if not new_ids:
            return 0, []
        self.jumps += 1
        return drop, new_ids

    def tokens_to_end(self, req: Req) -> None:
        return None  # unknown: batches stay in flight as before

    def shortest_output(self, req: Req) -> None:
        return None

    def tokens_left_at_most(self, req: Req) -> None:
        return None  # unbounded: launches are not cut short

    def fill_mask(self, reqs: list[Req]) -> None:
        return None

    def automaton_rows(self, reqs: list[Req], discard: list[bool]) -> None:
        return None

    def take_compile_times(self) -> list[float]:
        return []


def harness(*, overlap: bool, steps: int = 1, pool: int = 4096, on_device: bool = False, **kw) -> Harness:
    runner = ContentRunner(pool + 1)
    h = Harness(pool=pool, overlap=overlap, decode_steps=steps, runner=runner, **kw)
    runner.req_to_token = h.rows.req_to_token
    h.s.cfg = dataclasses.replace(h.s.cfg, enable_jump_forward=True, jump_overlap=True)
    h.s.grammar = ForcingGrammar(on_device=on_device)
    return h


def add(h: Harness, rid: str, prompt: list[int], max_new: int) -> Req:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, json_schema='{"type": "string"}')
    req = Req(
        rid=rid, origin_input_ids=prompt, params=params, stop_checker=StopChecker(params, eos_token_ids={EOS})
    )
    h.s.add_request(req)
    return req


def check_output(prompt: list[int], out: list[int]) -> None:
    """Every sampled token is the model's answer to everything before it (so the KV it read was
    right); forced tokens come in runs after a token divisible by 3."""
    for i, t in enumerate(out):
        if t < FORCED[0]:
            assert t == content_token(prompt + out[:i]), (i, out)


PROMPTS = [list(range(100 + i, 100 + i + n)) for i, n in enumerate([5, 17, 40, 3, 9, 26])]


def run(
    *, overlap: bool, steps: int = 1, on_device: bool = False, max_new: int = 40, **kw
) -> dict[str, list[int]]:
    return run_prompts(harness(overlap=overlap, steps=steps, on_device=on_device, **kw), max_new)


def run_prompts(h: Harness, max_new: int = 40) -> dict[str, list[int]]:
    """``PROMPTS`` through ``h`` to the end: every output runs its full length, every sampled
    token is the model's own, rows jumped, and ``Harness.run`` finds the pool whole."""
    for i, p in enumerate(PROMPTS):
        add(h, f"r{i}", p, max_new)
    h.run()
    out = h.outputs()
    assert h.s.grammar.jumps > 0
    for i, p in enumerate(PROMPTS):
        assert len(out[f"r{i}"]) == max_new
        check_output(p, out[f"r{i}"])
    assert any(FORCED[0] in o for o in out.values())
    assert all(f["type"] == "length" for f in h.finished().values())
    return out


@pytest.mark.parametrize("steps,on_device", [(1, False), (1, True), (4, True), (8, True)])
def test_overlap_gives_the_outputs_of_the_inline_loop(steps, on_device):
    """Jumps while a later launch is in flight: its tokens are thrown away, the row's KV is
    recomputed by the extend, and every output equals the inline loop's (run() also checks that
    every slot came back and the pool is whole)."""
    inline = run(overlap=False, steps=steps, on_device=on_device)
    assert run(overlap=True, steps=steps, on_device=on_device) == inline


def test_a_jump_in_flight_counts_its_launch_stale_and_waits_for_it():
    h = harness(overlap=True)
    req = add(h, "a", list(range(100, 110)), 30)
    tag = req.stop_tag
    while not h.s.jumped:
        assert h.s.step()
        if req.stale_outputs:
            break
    assert req in h.s.jumped and req not in h.s.running
    assert req.stale_outputs == req.pending_outputs == 1  # the decode launched before the jump
    assert req.stop_tag != tag  # a stop that stale launch samples must not mark what follows
    h.s.step()  # that launch is processed: its token is dropped, the request may extend
    assert req.stale_outputs == 0 and req.pending_outputs == 0
    h.run()
    check_output(list(range(100, 110)), h.outputs()["a"])


@pytest.mark.parametrize("overlap", [False, True])
def test_aborting_a_jumped_request_ends_it_and_frees_its_kv(overlap):
    h = harness(overlap=overlap)
    req = add(h, "a", list(range(100, 110)), 30)
    other = add(h, "b", list(range(200, 230)), 30)
    while req not in h.s.jumped:
        assert h.s.step()
    h.s.abort("a")
    h.run()  # checks the pool
    assert req.finished and h.finished()["a"]["type"] == "abort"
    assert len(h.outputs()["b"]) == 30 and other.finished


@pytest.mark.parametrize("overlap", [False, True])
def test_random_traffic_with_jumps_keeps_outputs_and_the_pool(overlap):
    h = harness(overlap=overlap, steps=4, on_device=True, pool=700, chunk=24, max_running=6)
    random_traffic(h, random.Random(7))


def random_traffic(h: Harness, rng: random.Random, *, abort_every: int = 0) -> None:
    """24 requests of random prompts and budgets arriving between steps (every ``abort_every``-th
    arrival aborts one added three before it), run to the end: every output is the model's own
    and ``Harness.run`` finds the pool whole."""
    prompts = {}
    for i in range(24):
        prompts[f"r{i}"] = [rng.randint(10, 59) for _ in range(rng.randint(1, 50))]
        add(h, f"r{i}", prompts[f"r{i}"], rng.randint(1, 48))
        for _ in range(rng.randint(0, 3)):
            h.s.step()
        if abort_every and i % abort_every == abort_every - 1:
            h.s.abort(f"r{i - 3}")
    h.run()
    out = h.outputs()
    for rid, p in prompts.items():
        check_output(p, out.get(rid, []))


def extend_overlap_harness(**kw) -> Harness:
    h = harness(overlap=True, **kw)
    h.s.cfg = dataclasses.replace(h.s.cfg, jump_overlap=False, jump_extend_overlap=True)
    return h


@pytest.mark.parametrize("steps", [1, 4])
def test_extend_overlap_keeps_jump_extends_in_flight_and_throws_nothing_away(steps):
    """jump_extend_overlap: the decode launch behind a jump's extend is queued before the extend
    is processed; a row whose extend token leads into a forced run decodes it in that launch
    instead of jumping, so no launch is thrown away and every output stays the model's own."""
    h = extend_overlap_harness(steps=steps, on_device=True)
    for i, p in enumerate(PROMPTS):
        add(h, f"r{i}", p, 40)
    extends_in_flight = 0
    while h.s.step():
        held = [b for b, _ in h.s.inflight]
        if held and held[0].is_prefill and all(r.output_ids for r in held[0].reqs):
            extends_in_flight += 1  # a jump's extend stays in flight behind this step
    h.run()
    assert extends_in_flight > 0 and h.s.grammar.jumps > 0
    assert h.s.stats.jump_stale_tokens == 0
    out = h.outputs()
    for i, p in enumerate(PROMPTS):
        assert len(out[f"r{i}"]) == 40
        check_output(p, out[f"r{i}"])


def test_a_jump_extend_leaves_output_tokens_out_of_the_tree_until_the_request_ends():
    """Prompt tokens enter the tree once computed; the forced tokens a jump extends are output
    tokens, which enter it at the end as decoded ones do (no insert per jump)."""
    h = harness(overlap=False)
    h.s.cfg = dataclasses.replace(h.s.cfg, jump_overlap=False)
    prompt = list(range(100, 110))
    req = add(h, "a", prompt, 30)
    while h.s.grammar.jumps == 0 or req in h.s.jumped:  # until a jump's extend is processed
        assert h.s.step()
    assert req.kv_len > len(prompt) + 1
    assert h.cache.tree.total_size == len(prompt)  # the prompt only
    h.run()
    # prompt and output at the end (a jump that reached max_new_tokens was never computed)
    assert h.cache.tree.total_size >= len(prompt) + 30 - len(FORCED) - 1
    check_output(prompt, h.outputs()["a"])
