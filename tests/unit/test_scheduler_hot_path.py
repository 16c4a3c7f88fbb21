"""The decode step's fast paths against the general code they stand in for: the plain decode
loop, the decode index, the future-map slice, the host tensor helper, ``Req.fill_slice`` and the
output collector's filter."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch
from phloem.runtime.cache.kv_pool import ReqToTokenPool
from phloem.runtime.executor.worker import FutureMap, _future_range
from phloem.runtime.forward_io import ForwardMode, SamplingInfo
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import FinishReason, StopChecker
from phloem.runtime.scheduler.batch import (
    ScheduledBatch,
    build_forward_input,
    extend_index,
    int64_tensor,
    write_decode_slots,
)
from phloem.runtime.scheduler.output import OutputCollector
from phloem.runtime.scheduler.req import Req

from tests.unit.test_scheduler_loop import Harness, token_after


def _req(rid: str, ids: list[int], *, stream: bool = False, **kw) -> Req:
    params = SamplingParams(temperature=0.0, **kw)
    return Req(rid=rid, origin_input_ids=ids, params=params, stop_checker=StopChecker(params), stream=stream)


# ---------------------------------------------------------------------- the plain decode loop
def _workload(h: Harness, seed: int, *, stream: bool) -> None:
    """Requests of mixed lengths and stops, a few aborts, steps interleaved with arrivals."""
    rng = random.Random(seed)
    reqs = []
    for i in range(24):
        prompt = [rng.randint(10, 60) for _ in range(rng.randint(1, 30))]
        kw: dict = {"ignore_eos": rng.random() < 0.5}
        if rng.random() < 0.3:  # a stop token the fake model emits a few tokens in
            kw["stop_token_ids"] = [token_after(len(prompt) - 1 + rng.randint(0, 8))]
        if rng.random() < 0.2:
            kw["min_new_tokens"] = rng.randint(0, 4)
        req = h.add(f"r{i}", prompt, max_new=rng.randint(1, 40), **kw)
        req.stream = stream
        reqs.append(req)
        for _ in range(rng.randint(0, 4)):
            h.s.step()
        if rng.random() < 0.1:
            h.s.abort(rng.choice(reqs).rid, message="test abort")
    h.run()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("pool", [4096, 200])  # 200: retractions
def test_plain_decode_loop_matches_the_general_loop(overlap, stream, pool):
    fast = Harness(pool=pool, overlap=overlap, max_running=8)
    general = Harness(pool=pool, overlap=overlap, max_running=8)
    general.s.decode_step.is_plain = lambda batch, out: False  # every step through process_rows
    taken = []
    decode_rows = fast.s.decode_step.process_plain_rows
    fast.s.decode_step.process_plain_rows = lambda reqs, tokens: (taken.append(len(reqs)), decode_rows(reqs, tokens))
    _workload(fast, 7, stream=stream)
    _workload(general, 7, stream=stream)
    assert taken, "the plain decode loop never ran"
    assert msgspec.to_builtins(fast.sent) == msgspec.to_builtins(general.sent)


# ---------------------------------------------------------------------- the decode index
def test_decode_index_gives_the_general_forward_input():
    rng = random.Random(0)
    pools = [ReqToTokenPool(8, 64, "cpu") for _ in range(2)]
    reqs = []
    for i in range(5):
        req = _req(f"r{i}", [1] * rng.randint(1, 30))
        req.req_pool_idx = pools[0].alloc()
        assert pools[1].alloc() == req.req_pool_idx
        req.kv_len = rng.randint(1, 40)
        reqs.append(req)
    slots = torch.tensor([rng.randint(1, 1000) for _ in reqs], dtype=torch.int64)
    info = SamplingInfo(*(torch.zeros(len(reqs)) for _ in range(4)))
    ids = [rng.randint(-9, 60) for _ in reqs]

    def batch(index):
        return ScheduledBatch(mode=ForwardMode.DECODE, reqs=reqs, decode_index=index,
                              prefix_lens=[r.kv_len for r in reqs], extend_lens=[1] * len(reqs))  # fmt: skip

    index = write_decode_slots(pools[0].req_to_token, reqs, slots)
    for r, s in zip(reqs, slots.tolist()):  # what the general path reads back
        pools[1].req_to_token[r.req_pool_idx, r.kv_len] = s
    assert torch.equal(pools[0].req_to_token, pools[1].req_to_token)
    fast = build_forward_input(batch(index), req_to_token=pools[0].req_to_token, input_ids=ids, sampling=info)
    general = build_forward_input(
        batch(None), req_to_token=pools[1].req_to_token, input_ids=ids, sampling=info
    )
    for name in "input_ids positions out_slots req_pool_indices seq_lens prefix_lens extend_lens".split():
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b), name


@pytest.mark.parametrize("seed", range(6))
def test_extend_index_is_every_new_token_row_and_position(seed):
    import numpy as np

    rng = random.Random(seed)
    n = rng.randint(1, 12)
    rows = [rng.randint(0, 50) for _ in range(n)]
    prefix = [rng.randint(0, 900) for _ in range(n)]
    extend = [rng.choice([0, 1, rng.randint(1, 700)]) for _ in range(n)]
    want = [[r for r, e in zip(rows, extend) for _ in range(e)],
            [p + j for p, e in zip(prefix, extend) for j in range(e)]]  # fmt: skip
    got = extend_index(*(np.array(v, dtype=np.int64) for v in (rows, prefix, extend)))
    assert got.dtype == np.int64 and got.tolist() == want


@pytest.mark.parametrize("values", [[], [3], [1, -2, 1 << 40], [[1, 2], [3, 4]], [[], []]])
def test_int64_tensor_matches_torch_tensor(values):
    a, b = int64_tensor(values), torch.tensor(values, dtype=torch.int64)
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# ---------------------------------------------------------------------- the future map
def _resolve_general(fmap: FutureMap, ids: torch.Tensor) -> torch.Tensor:
    return torch.where(ids < 0, fmap.buf[(-ids).clamp(min=0)], ids)


def test_future_map_reserves_contiguous_ranges_that_wrap():
    fmap = FutureMap(10)
    assert fmap.reserve(4) == range(1, 5)
    assert fmap.reserve(6) == range(5, 11)
    assert fmap.reserve(3) == range(1, 4)  # would run past the end: starts over
    assert fmap.reserve(0) == range(4, 4)


def test_future_map_slice_resolve_matches_the_general_resolve():
    rng = random.Random(0)
    fmap = FutureMap(40)
    fmap.store(range(1, 41), torch.tensor([rng.randint(0, 99) for _ in range(40)]))
    cases = [[-5, -6, -7], [-1], [-40], [-5, -7], [-6, -5], [3, 4], [-5, 4], [0, -1], [], [0], [-3, -4, 9]]
    cases += [[-k for k in range(s, s + n)] for s, n in ((1, 40), (12, 7))]
    for ids in cases:
        t = torch.tensor(ids, dtype=torch.int64)
        contiguous = bool(ids) and ids[0] < 0 and ids == list(range(ids[0], ids[0] - len(ids), -1))
        assert (_future_range(t) is not None) == contiguous, ids
        assert torch.equal(fmap.resolve(t), _resolve_general(fmap, t)), ids
    sliced = fmap.resolve(torch.tensor([-2, -3]))
    sliced += 1000  # a copy: the ring buffer is untouched
    assert fmap.buf[2] < 1000


# ---------------------------------------------------------------------- Req.fill_slice
def test_fill_slice_matches_slicing_fill_ids():
    req = _req("r", [5, 6, 7, 8])
    for outputs in ([], [1], [1, 2, 3]):
        req.output_ids = list(outputs)
        total = len(req.fill_ids)
        for start in range(total + 2):
            for stop in range(total + 3):
                assert req.fill_slice(start, stop) == req.fill_ids[start:stop], (outputs, start, stop)


def test_wants_token_is_unfinished_with_tokens_left():
    req = _req("r", [5, 6], max_new_tokens=3)
    for outputs, pending, finished in [
        (0, 0, False),
        (2, 0, False),
        (2, 1, False),
        (3, 0, False),
        (1, 0, True),
    ]:
        req.output_ids, req.pending_outputs = [7] * outputs, pending
        req.finished_reason = FinishReason.length(3) if finished else None
        assert req.wants_token == (not req.finished and req.remaining_new_tokens > 0)


# ---------------------------------------------------------------------- the output collector
def test_collector_sends_only_streaming_or_finished_requests():
    sent: list = []
    out = OutputCollector(lambda m: sent.extend(m.outs))
    quiet, streaming = _req("quiet", [1, 2]), _req("streaming", [1, 2], stream=True)
    for req in (quiet, streaming):
        req.output_ids.append(9)
        out.add(req)
    out.flush()
    assert [o.rid for o in sent] == ["streaming"]
    quiet.output_ids.append(10)
    quiet.finish(FinishReason.length(2))
    out.add(quiet)  # a finished request is marked again after finish()
    out.flush()
    assert [(o.rid, o.new_ids) for o in sent] == [("streaming", [9]), ("quiet", [9, 10])]
