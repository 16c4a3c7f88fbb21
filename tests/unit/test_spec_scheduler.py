"""The real Scheduler taking speculative steps on a tiny random model: random requests, aborts and a
small pool (retraction) leave the KV pool and the radix tree intact, and every request that ran to
its length has exactly the plain greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch
from phloem.runtime.cache.allocator import TokenSlotAllocator
from phloem.runtime.cache.cache_manager import CacheManager
from phloem.runtime.cache.radix_tree import RadixTree
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.executor.worker import FutureMap, InlineWorker
from phloem.runtime.sampling.batch import SamplingBatchBuilder
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import StopChecker
from phloem.runtime.scheduler.output import OutputCollector
from phloem.runtime.scheduler.req import Req
from phloem.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
from phloem.runtime.speculative.decoding import EagleDrafter
from phloem.runtime.speculative.eagle import EagleConfig, EagleDraftWorker, EagleHead
from phloem.runtime.speculative.step import SpeculativeStep, build_speculative_step

from tests.unit.tiny_model import tiny_runner

EOS = 1


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    torch.set_num_threads(1)
    return tiny_runner(5)


def _spec(runner: ModelRunner, algorithm: str) -> SpeculativeStep:
    if algorithm == "NGRAM":
        return build_speculative_step(runner, "NGRAM", num_draft_tokens=4)
    head = EagleHead(EagleConfig.from_target(runner.model_config))
    head.reset_parameters(torch.Generator().manual_seed(0))
    worker = EagleDraftWorker.for_runner(head, runner, num_steps=3, topk=2, num_draft_tokens=6)
    return SpeculativeStep(runner, EagleDrafter(worker), max_tree=6)


def add_random_requests(s: Scheduler, rng: random.Random, *, sampled: float = 0.0) -> list[Req]:
    """24 requests over two shared stems with random lengths, steps between them and aborts of
    earlier ones; ``sampled``: the share of rows sampled at temperature 0.8 (the rest greedy)."""
    stems = [[rng.randint(2, 500) for _ in range(30)] for _ in range(2)]
    reqs: list[Req] = []
    for i in range(24):
        ids = rng.choice(stems)[: rng.randint(4, 30)] + [rng.randint(2, 500) for _ in range(rng.randint(1, 12))]
        temperature = 0.8 if sampled and rng.random() < sampled else 0.0
        params = SamplingParams(max_new_tokens=rng.randint(1, 40), temperature=temperature)
        req = Req(rid=f"r{i}", origin_input_ids=ids, params=params,
                  stop_checker=StopChecker(params, eos_token_ids={EOS}))  # fmt: skip
        s.add_request(req)
        reqs.append(req)
        for _ in range(rng.randint(0, 4)):
            s.step()
        if rng.random() < 0.2:
            s.abort(rng.choice(reqs).rid, message="test abort")
    return reqs


@pytest.mark.parametrize("algorithm", ["EAGLE"])  # its draft KV is what aborts could leak
def test_random_requests_aborts_and_retraction_keep_pool_and_outputs(runner, algorithm):
    pool = 160  # a few requests' worth: decode growth forces retraction
    allocator = TokenSlotAllocator(pool, check=True)
    rows = runner.req_to_token_pool
    cache = CacheManager(allocator=allocator, req_to_token=rows.req_to_token, tree=RadixTree())
    sent = []
    cfg = SchedulerConfig(max_running_requests=6, max_prefill_tokens=512, chunked_prefill_size=24, overlap=False)
    s = Scheduler(cfg, cache=cache, req_pool=rows, worker=InlineWorker(runner, FutureMap(64)),
                  sampling=SamplingBatchBuilder(runner.vocab_size, eos_token_ids=[EOS]),
                  outputs=OutputCollector(lambda m: sent.extend(m.outs)), spec=_spec(runner, algorithm))  # fmt: skip
    reqs = add_random_requests(s, random.Random(1))
    for _ in range(5000):
        if not s.step() and s.is_idle:
            break
    s.drain()
    assert s.is_idle
    cache.check_integrity()
    assert cache.free_size + cache.evictable_size == cache.total_size
    assert rows.available_size == rows.size
    finished = {o.rid: o.finished for o in sent if o.finished is not None}
    assert set(finished) == {r.rid for r in reqs}
    assert s.spec.verify_count > 0
    assert s.stats.num_retracted > 0  # the small pool did force retraction
    got: dict[str, list[int]] = {}
    for o in sent:
        got.setdefault(o.rid, []).extend(o.new_ids)
    plain = DirectBatcher(runner)
    checked = 0
    for r in reqs:
        if finished[r.rid]["type"] == "length":
            assert got[r.rid] == plain.generate_greedy(r.origin_input_ids, r.params.max_new_tokens), r.rid
            checked += 1
    assert checked >= 6
