"""The scheduler loop end to end with a fake model: every token is a function of its position,
so outputs are predictable whatever the batching, chunking, overlap or retraction."""

from __future__ import annotations

import random

import pytest
import torch
from phloem.runtime.cache.allocator import TokenSlotAllocator
from phloem.runtime.cache.cache_manager import CacheManager
from phloem.runtime.cache.kv_pool import ReqToTokenPool
from phloem.runtime.cache.radix_tree import RadixTree
from phloem.runtime.executor.worker import FutureMap, InlineWorker, OverlapWorker
from phloem.runtime.forward_io import ForwardOutput
from phloem.runtime.sampling.batch import SamplingBatchBuilder
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import StopChecker
from phloem.runtime.scheduler.output import OutputCollector
from phloem.runtime.scheduler.req import Req
from phloem.runtime.scheduler.scheduler import Scheduler, SchedulerConfig

VOCAB = 64
EOS = 1


def token_after(position: int) -> int:
    """The fake model's output after the token at ``position``."""
    return 10 + (position * 7) % 50


class FakeRunner:
    """Checks that each step's KV slots are ones the scheduler allocated, records positions."""

    def __init__(self, pool_slots: int) -> None:
        self.kv_owner = torch.full((pool_slots,), -1, dtype=torch.int64)
        self.steps = 0

    def forward(self, fi) -> ForwardOutput:
        assert (fi.input_ids >= 0).all(), "unresolved future id reached the model"
        assert (fi.out_slots > 0).all(), "slot 0 is padding and never written"
        self.kv_owner[fi.out_slots] = fi.positions
        ends = torch.cumsum(fi.extend_lens, 0) - 1
        last_pos = fi.positions[ends]
        toks = torch.tensor([token_after(int(p)) for p in last_pos], dtype=torch.int64)
        self.steps += 1
        return ForwardOutput(next_token_ids=toks, next_token_ids_cpu=toks.clone())


class Harness:
    def __init__(self, *, pool: int, overlap: bool, chunk: int | None = None, radix: bool = True,
                 max_running: int = 16, mixed: bool = False, priority: bool = False, policy: str = "fcfs",
                 decode_steps: int = 1, decode_budget_s: float = 0.0, runner: FakeRunner | None = None) -> None:
        self.allocator = TokenSlotAllocator(pool + 1, check=True)
        self.rows = ReqToTokenPool(max_running, 4096, "cpu")
        self.cache = CacheManager(allocator=self.allocator, req_to_token=self.rows.req_to_token,
                                  tree=RadixTree() if radix else None)
        self.runner = runner or FakeRunner(pool + 1)
        fmap = FutureMap(4 * max_running + 8)
        worker = OverlapWorker(self.runner, fmap) if overlap else InlineWorker(self.runner, fmap)
        self.sent = []
        cfg = SchedulerConfig(max_running_requests=max_running, max_prefill_tokens=4096,
                              chunked_prefill_size=chunk, overlap=overlap, enable_mixed_chunk=mixed,
                              enable_priority_scheduling=priority, priority_preemption_threshold=5,
                              schedule_policy=policy, decode_steps=decode_steps, decode_budget_s=decode_budget_s)
        self.s = Scheduler(cfg, cache=self.cache, req_pool=self.rows, worker=worker,
                           sampling=SamplingBatchBuilder(VOCAB, eos_token_ids=[EOS]),
                           outputs=OutputCollector(lambda m: self.sent.extend(m.outs)))

    def add(self, rid: str, ids: list[int], max_new: int, priority: int = 0, **kw) -> Req:
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0, **kw)
        req = Req(rid=rid, origin_input_ids=ids, params=params, stop_checker=StopChecker(params, eos_token_ids={EOS}),
                  priority=priority)
        self.s.add_request(req)
        return req

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.s.step() and self.s.is_idle:
                break
        self.s.drain()
        assert self.s.is_idle
        self.cache.check_integrity()
        assert self.cache.free_size + self.cache.evictable_size == self.cache.total_size

    def outputs(self) -> dict[str, list[int]]:
        got: dict[str, list[int]] = {}
        for o in self.sent:
            got.setdefault(o.rid, []).extend(o.new_ids)
        return got

    def finished(self) -> dict[str, dict]:
        return {o.rid: o.finished for o in self.sent if o.finished is not None}


def expected(prompt_len: int, n: int) -> list[int]:
    return [token_after(prompt_len - 1 + i) for i in range(n)]


@pytest.mark.parametrize("overlap", [False, True])
def test_batch_of_requests_gets_position_exact_outputs(overlap):
    h = Harness(pool=4096, overlap=overlap)
    lens = [5, 17, 40, 3]
    for i, n in enumerate(lens):
        h.add(f"r{i}", list(range(100 + i, 100 + i + n)), max_new=12)
    h.run()
    out = h.outputs()
    for i, n in enumerate(lens):
        assert out[f"r{i}"] == expected(n, 12)
    assert all(f["type"] == "length" for f in h.finished().values())


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_matches_unchunked(overlap):
    h = Harness(pool=4096, overlap=overlap, chunk=16)
    h.add("long", list(range(200, 300)), max_new=5)
    h.add("short", list(range(300, 310)), max_new=5)
    h.run()
    assert h.outputs()["long"] == expected(100, 5)
    assert h.outputs()["short"] == expected(10, 5)


@pytest.mark.parametrize("overlap", [False, True])
def test_shared_prefix_is_reused_from_tree(overlap):
    h = Harness(pool=4096, overlap=overlap)
    stem = list(range(500, 600))
    first = h.add("a", stem + [1, 2, 3], max_new=4)
    h.run()
    second = h.add("b", stem + [4, 5], max_new=4)
    h.run()
    assert first.cached_tokens == 0
    assert second.cached_tokens >= 100


@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_pool_retracts_and_everyone_finishes(overlap):
    h = Harness(pool=300, overlap=overlap, max_running=16)
    reqs = [h.add(f"r{i}", list(range(1000 + 50 * i, 1000 + 50 * i + 30)), max_new=60) for i in range(8)]
    h.run()
    out = h.outputs()
    for r in reqs:
        assert out[r.rid] == expected(30, 60), r.rid
    assert sum(r.num_retractions for r in reqs) > 0


def test_request_larger_than_pool_is_aborted_with_message():
    h = Harness(pool=64, overlap=False)
    h.add("big", list(range(100, 200)), max_new=4)
    h.add("ok", list(range(100, 110)), max_new=4)
    h.run()
    fin = h.finished()
    assert fin["big"]["type"] == "abort" and "KV cache" in fin["big"]["message"]
    assert fin["ok"]["type"] == "length"


def test_output_that_outgrows_the_pool_alone_is_aborted_not_hung():
    h = Harness(pool=64, overlap=True)
    h.add("grows", list(range(100, 130)), max_new=100, ignore_eos=True)
    h.run()
    assert h.finished()["grows"]["type"] == "abort"


def random_traffic(h: Harness, rng: random.Random, make_ids, *, max_steps_between: int) -> list[Req]:
    """60 requests arriving between scheduler steps, some aborted; everyone finishes, the pool
    invariant holds (``run``), and every request that ran to its length got the exact tokens."""
    reqs = []
    for i in range(60):
        reqs.append(h.add(f"r{i}", make_ids(rng), max_new=rng.randint(0, 40)))
        for _ in range(rng.randint(0, max_steps_between)):
            h.s.step()
        if rng.random() < 0.15:
            h.s.abort(rng.choice(reqs).rid, message="test abort")
    h.run()
    fin = h.finished()
    assert set(fin) == {r.rid for r in reqs}
    out = h.outputs()
    for r in reqs:
        if fin[r.rid]["type"] == "length":
            assert out.get(r.rid, []) == expected(r.prompt_len, r.params.max_new_tokens)
    return reqs


@pytest.mark.parametrize("overlap", [False, True])
def test_random_requests_and_aborts_keep_the_pool_invariant(overlap):
    h = Harness(pool=512, overlap=overlap, chunk=32, max_running=8)
    stems = [list(range(2000 + 100 * k, 2000 + 100 * k + 40)) for k in range(3)]

    def ids(rng: random.Random) -> list[int]:
        return rng.choice(stems)[: rng.randint(1, 40)] + [rng.randint(10, 60) for _ in range(rng.randint(1, 30))]

    random_traffic(h, random.Random(0), ids, max_steps_between=3)


def test_mixed_chunk_runs_decode_rows_with_prefill():
    h = Harness(pool=4096, overlap=False, chunk=8, mixed=True)
    h.add("a", list(range(100, 110)), max_new=20)
    for _ in range(4):
        h.s.step()
    h.add("b", list(range(300, 364)), max_new=3)
    h.run()
    assert h.outputs()["a"] == expected(10, 20)
    assert h.outputs()["b"] == expected(64, 3)


def test_eos_stops_and_min_new_tokens_delays_it():
    h = Harness(pool=1024, overlap=False)
    # stop_token_ids makes the fake model's 3rd output a stop token
    third = token_after(10 - 1 + 2)
    h.add("stop", list(range(100, 110)), max_new=10, stop_token_ids=[third])
    h.run()
    assert h.outputs()["stop"] == expected(10, 3)
    assert h.finished()["stop"] == {"type": "stop", "matched": third}


@pytest.mark.parametrize("overlap", [False, True])
def test_high_priority_request_preempts_low_priority_ones(overlap):
    h = Harness(pool=300, overlap=overlap, priority=True, max_running=8)
    low = [h.add(f"low{i}", list(range(100 + 40 * i, 130 + 40 * i)), max_new=60, priority=0, ignore_eos=True)
           for i in range(3)]
    for _ in range(6):
        h.s.step()
    assert all(r.req_pool_idx is not None for r in low)  # all three running
    high = h.add("high", list(range(900, 960)), max_new=40, priority=10, ignore_eos=True)
    h.s.step()
    h.s.step()
    assert high.req_pool_idx is not None or high.finished  # admitted at once by preemption
    h.run()
    out = h.outputs()
    assert out["high"] == expected(60, 40)
    assert all(out[r.rid] == expected(30, 60) for r in low)
    assert sum(r.num_retractions for r in low) > 0


def test_lpm_policy_serves_everyone_correctly():
    h = Harness(pool=2048, overlap=False, policy="lpm")
    stem = list(range(3000, 3100))
    h.add("seed", stem + [1], max_new=2)
    h.run()
    reqs = [h.add(f"r{i}", (stem if i % 2 else list(range(5000 + i, 5100 + i))) + [i], max_new=3) for i in range(6)]
    h.run()
    out = h.outputs()
    for r in reqs:
        assert out[r.rid] == expected(r.prompt_len, 3)
    assert all(r.cached_tokens >= 100 for r in reqs[1::2])


@pytest.mark.parametrize("overlap", [False, True])
def test_siblings_arriving_together_compute_their_stem_once(overlap):
    h = Harness(pool=4096, overlap=overlap)
    stem = list(range(7000, 7100))
    reqs = [h.add(f"s{i}", stem + [i + 1, i + 2], max_new=20) for i in range(4)]
    h.run()
    out = h.outputs()
    assert all(out[r.rid] == expected(102, 20) for r in reqs)
    # the first computes the stem; the others read it from the tree while it is still running
    assert sorted(r.cached_tokens for r in reqs)[1:] == [100, 100, 100]


def test_the_forward_thread_runs_on_the_runners_cuda_device(monkeypatch):
    """A new thread starts on CUDA device 0, whatever the process set: the forward thread of a
    replica on another GPU sets the runner's device first, so stream-less calls there (a copy's
    event, the step timer's) land on that GPU. A CPU runner sets nothing."""
    from types import SimpleNamespace

    seen: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(str(d)))
    OverlapWorker(SimpleNamespace(device=torch.device("cuda:1")), FutureMap(8)).close()
    OverlapWorker(SimpleNamespace(device=torch.device("cpu")), FutureMap(8)).close()
    assert seen == ["cuda:1"]
