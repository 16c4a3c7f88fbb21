"""The real Scheduler with a hierarchical cache and a fake model that reads its KV back.

The fake model writes (token id, position) as each token's K and V, and its next token is a function
of every K and V of the row: a prefix loaded back from the host with a wrong or stale KV changes the
output. Multi-turn sessions whose contexts exceed the tiny device pool must then report host hits
and produce exactly the tokens of a run without the hierarchical cache.

``layerwise`` runs the CUDA copier's path on the CPU (stand-in streams): loads are only staged when a
request is admitted and land when the worker hands them to the next forward pass, so a load handed
to the wrong step, or never, shows up as a wrong KV.
"""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.cache.allocator import TokenSlotAllocator
from phloem.runtime.cache.cache_manager import CacheManager
from phloem.runtime.cache.hicache import HiCacheConfig, HiCacheController
from phloem.runtime.cache.host_pool import CudaStreamCopier, HostKVPool, LayerwiseLoader
from phloem.runtime.cache.kv_pool import KVPool, ReqToTokenPool
from phloem.runtime.cache.radix_tree import RadixTree
from phloem.runtime.executor.worker import FutureMap, InlineWorker, OverlapWorker
from phloem.runtime.forward_io import ForwardOutput
from phloem.runtime.sampling.batch import SamplingBatchBuilder
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import StopChecker
from phloem.runtime.scheduler.output import OutputCollector
from phloem.runtime.scheduler.req import Req
from phloem.runtime.scheduler.scheduler import Scheduler, SchedulerConfig

from tests.unit.test_hicache_layerwise import FakeStreams

VOCAB = 64
EOS = 1


class KVReadingRunner:
    """Writes K = token id, V = position for every new token; the next token hashes the whole row."""

    def __init__(self, pool: KVPool, rows: ReqToTokenPool, kv_loader: LayerwiseLoader | None = None) -> None:
        self.pool, self.rows, self.kv_loader = pool, rows, kv_loader
        self.loads_started = 0

    def forward(self, fi, kv_loads=()) -> ForwardOutput:
        if kv_loads:  # this fake reads every layer at once
            self.kv_loader.start(kv_loads).finish()
            self.loads_started += len(kv_loads)
        assert (fi.input_ids >= 0).all() and (fi.out_slots > 0).all()
        ids = fi.input_ids.to(torch.float32)[:, None, None]
        self.pool.set_kv(0, fi.out_slots, ids, fi.positions.to(torch.float32)[:, None, None])
        toks = []
        for row, n in zip(fi.req_pool_indices.tolist(), fi.seq_lens.tolist()):
            slots = self.rows.req_to_token[row, :n]
            k, v = self.pool.get_kv(0)
            positions = v[slots].reshape(-1)
            assert torch.equal(positions, torch.arange(n, dtype=torch.float32)), "KV of a wrong position"
            weights = torch.arange(1, n + 1, dtype=torch.float64)
            toks.append(10 + int((k[slots].reshape(-1).double() * weights).sum().item()) % 50)
        out = torch.tensor(toks, dtype=torch.int64)
        return ForwardOutput(next_token_ids=out, next_token_ids_cpu=out.clone())


class Harness:
    def __init__(
        self,
        *,
        pool: int,
        overlap: bool,
        hicache: str | None,
        chunk: int | None = None,
        max_running: int = 8,
        layerwise: bool = False,
    ) -> None:
        self.kv = KVPool(1, pool + 1, 1, 1, torch.float32, "cpu")
        self.rows = ReqToTokenPool(max_running, 4096, "cpu")
        tree = RadixTree()
        hc = None
        self.loader = LayerwiseLoader(self.kv, streams=FakeStreams()) if layerwise else None
        if hicache is not None:
            host = HostKVPool.like(self.kv, 2 * pool, check=True)
            copier = CudaStreamCopier(self.loader, deferred=True) if self.loader is not None else None
            hc = HiCacheController(
                tree=tree,
                device_pool=self.kv,
                host_pool=host,
                config=HiCacheConfig(write_policy=hicache),
                copier=copier,
            )
        self.cache = CacheManager(
            allocator=TokenSlotAllocator(pool + 1, check=True),
            req_to_token=self.rows.req_to_token,
            tree=tree,
            hicache=hc,
        )
        fmap = FutureMap(4 * max_running + 8)
        self.runner = runner = KVReadingRunner(self.kv, self.rows, self.loader)
        worker = OverlapWorker(runner, fmap) if overlap else InlineWorker(runner, fmap)
        self.sent = []
        cfg = SchedulerConfig(
            max_running_requests=max_running,
            max_prefill_tokens=4096,
            chunked_prefill_size=chunk,
            overlap=overlap,
        )
        self.s = Scheduler(
            cfg,
            cache=self.cache,
            req_pool=self.rows,
            worker=worker,
            sampling=SamplingBatchBuilder(VOCAB, eos_token_ids=[EOS]),
            outputs=OutputCollector(lambda m: self.sent.extend(m.outs)),
        )

    def add(self, rid: str, ids: list[int], max_new: int) -> Req:
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
        req = Req(
            rid=rid,
            origin_input_ids=ids,
            params=params,
            stop_checker=StopChecker(params, eos_token_ids={EOS}),
        )
        self.s.add_request(req)
        return req

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.s.step() and self.s.is_idle:
                break
        self.s.drain()
        assert self.s.is_idle
        self.cache.check_integrity()  # every tier
        assert self.cache.free_size + self.cache.evictable_size == self.cache.total_size

    def outputs(self) -> dict[str, list[int]]:
        got: dict[str, list[int]] = {}
        for o in self.sent:
            got.setdefault(o.rid, []).extend(o.new_ids)
        return got


def chat(h: Harness, *, sessions: int = 4, turns: int = 4, system: int = 70) -> dict[str, Req]:
    """Round-robin multi-turn sessions sharing a system prompt: each turn's prompt is the whole
    conversation so far (write_through_selective keeps only what is reused: the shared part)."""
    shared = [2 + (i * 7) % 60 for i in range(system)]
    history = {s: shared + [2 + (s * 13 + i) % 60 for i in range(10)] for s in range(sessions)}
    reqs = {}
    for t in range(turns):
        for s in range(sessions):
            prompt = history[s] + [3 + (s + t + i) % 50 for i in range(12)]
            req = h.add(f"s{s}t{t}", prompt, max_new=6)
            h.run()
            history[s] = prompt + h.outputs()[req.rid]
            reqs[req.rid] = req
    return reqs


@pytest.mark.parametrize("layerwise", [False, True], ids=["plain", "layerwise"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_multi_turn_sessions_hit_the_host_tier_and_match_a_run_without_it(overlap, policy, layerwise):
    baseline = Harness(pool=256, overlap=overlap, hicache=None)
    chat(baseline)
    h = Harness(pool=256, overlap=overlap, hicache=policy, layerwise=layerwise)
    reqs = chat(h)
    if layerwise:
        assert h.runner.loads_started > 0 and h.loader.take() == []
    assert h.outputs() == baseline.outputs()
    later = [r for rid, r in reqs.items() if not rid.endswith("t0")]
    host_hits = sum(r.cached_tokens_details["host"] for r in later)
    assert host_hits > 0
    for r in reqs.values():
        d = r.cached_tokens_details
        assert d["device"] + d["host"] + d["storage"] == r.cached_tokens
    stats = h.s.live_stats()
    assert stats["hicache_host_hit_tokens"] == host_hits
    assert stats["hicache_bytes_host_to_device"] > 0


def test_chunked_prefill_with_host_hits_matches():
    baseline = Harness(pool=256, overlap=True, hicache=None, chunk=32)
    chat(baseline, turns=3)
    h = Harness(pool=256, overlap=True, hicache="write_through", chunk=32)
    chat(h, turns=3)
    assert h.outputs() == baseline.outputs()
    assert h.s.live_stats()["hicache_host_hit_tokens"] > 0


@pytest.mark.parametrize("layerwise", [False, True], ids=["plain", "layerwise"])
def test_concurrent_sessions_with_retraction_keep_every_tier_consistent(layerwise):
    h = Harness(pool=200, overlap=True, hicache="write_back", max_running=8, layerwise=layerwise)
    base = Harness(pool=200, overlap=True, hicache=None, max_running=8)
    for harness in (h, base):
        for t in range(3):
            for s in range(6):
                harness.add(f"s{s}t{t}", [2 + (s * 11 + i) % 60 for i in range(60)] + [t + 3] * 5, max_new=30)
            harness.run()
    assert h.outputs() == base.outputs()
