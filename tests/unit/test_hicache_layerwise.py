"""Layer-wise host -> device KV loads, on the CPU with stand-in streams that log every stream operation.

The CUDA path stages a load on a copy stream (one event per layer) when a request is admitted; the
forward pass of the next batch launched waits for layer l's event and scatters layer l into the pool
right before attention of layer l. ``FakeStreams`` runs every copy at once and logs events and waits,
so these tests pin that order (copy of layer l, wait, scatter, attention of layer l, and layer l + 1
still missing at that point) and the hand-off of loads to the right step, without a GPU.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch
from phloem.runtime.cache.host_pool import (
    CudaStreamCopier,
    HostKVPool,
    KVCopier,
    LayerwiseLoader,
    slot_runs,
)
from phloem.runtime.cache.kv_pool import KVPool
from phloem.runtime.executor.worker import FutureMap, InlineWorker, OverlapWorker
from phloem.runtime.forward_io import ForwardInput, ForwardMode, ForwardOutput

LAYERS, HEADS, DIM = 3, 2, 4


@dataclass(eq=False)
class FakeEvent:
    id: int
    stream: str
    fired: bool = True


class FakeStreams:
    """The members of ``CudaStreams`` on the CPU: copies run at once; stream operations are logged as
    ``("record", stream, event id)``, ``("wait", "compute", event id)``, ``("wait_for_compute", stream)``
    and ``("synchronize", stream or event id)``."""

    pin_memory = False
    copy = "copy"

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.events: list[FakeEvent] = []

    def current(self):
        return "compute"

    def on(self, stream):
        return nullcontext()

    def record(self, stream) -> FakeEvent:
        event = FakeEvent(len(self.events) + 1, stream)
        self.events.append(event)
        self.log.append(("record", stream, event.id))
        return event

    def wait_for_compute(self, stream) -> None:
        self.log.append(("wait_for_compute", stream))

    def compute_waits(self, event) -> None:
        self.log.append(("wait", "compute", event.id))

    def done(self, event) -> bool:
        return event.fired

    def synchronize(self, stream_or_event) -> None:
        self.log.append(("synchronize", getattr(stream_or_event, "id", stream_or_event)))

    def record_use(self, tensor, stream) -> None:
        pass


def pools(device_tokens: int = 64, host_tokens: int = 64) -> tuple[KVPool, HostKVPool]:
    pool = KVPool(LAYERS, device_tokens + 1, HEADS, DIM, torch.float32, "cpu")
    host = HostKVPool.like(pool, host_tokens)
    for layer in range(LAYERS):  # host slot s of layer l holds K = 100 l + s, V = -K
        vals = (100 * layer + torch.arange(host.num_slots, dtype=torch.float32))[:, None, None]
        host.k_buffer[layer].copy_(vals.expand(-1, HEADS, DIM))
        host.v_buffer[layer].copy_(-vals.expand(-1, HEADS, DIM))
    return pool, host


def test_slot_runs():
    assert slot_runs(torch.tensor([3, 4, 5, 9, 10, 2])) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert slot_runs(torch.tensor([7])) == [(0, 7, 1)]
    assert slot_runs(torch.empty(0, dtype=torch.int64)) == []


@pytest.mark.parametrize(
    "host_slots", [list(range(10, 30)), list(range(40, 20, -1))], ids=["runs", "scattered"]
)
def test_each_layer_is_scattered_when_its_attention_asks_and_not_before(host_slots):
    pool, host = pools()
    fake = FakeStreams()
    loader = LayerwiseLoader(pool, streams=fake)
    hs, ds = torch.tensor(host_slots), torch.arange(5, 25)
    load = loader.stage(host, hs, ds)
    # staged: one copy-stream event per layer, the pool untouched, the slots not landed
    copied = [e.id for e in load.copied]
    assert fake.log == [("record", "copy", c) for c in copied] and len(copied) == LAYERS
    assert not pool.k_buffer[0][ds].any()
    assert loader.landing(torch.tensor([7])) and not loader.landing(torch.tensor([30]))
    assert loader.take() == [load] and loader.take() == []

    def landed_layers() -> list[bool]:
        return [bool(torch.equal(pool.k_buffer[i][ds], host.k_buffer[i][hs])) for i in range(LAYERS)]

    fake.log.clear()
    ready = loader.start([load])
    assert fake.log == [] and landed_layers() == [False] * LAYERS
    ready.wait(1)  # attention of layer 1 (layer 0 never asked): both go in, in order
    assert fake.log == [("wait", "compute", copied[0]), ("wait", "compute", copied[1])]
    assert landed_layers() == [True, True, False]
    ready.wait(1)  # asking again changes nothing
    assert len(fake.log) == 2
    landed = ready.finish()
    assert fake.log[2:] == [("wait", "compute", copied[2]), ("record", "compute", landed.id)]
    assert landed_layers() == [True] * LAYERS
    for layer in range(LAYERS):
        assert torch.equal(pool.v_buffer[layer][ds], -pool.k_buffer[layer][ds])
    assert load.staging is None and load.landed is landed and not loader.landing(ds)
    with pytest.raises(RuntimeError, match="twice"):
        loader.start([load])


def test_a_load_is_landing_until_its_last_scatter_is_done():
    pool, host = pools()
    fake = FakeStreams()
    loader = LayerwiseLoader(pool, streams=fake)
    load = loader.stage(host, torch.arange(1, 9), torch.arange(1, 9))
    loader.start(loader.take()).finish()
    load.landed.fired = False  # the load stream has not got there yet
    assert loader.landing(torch.tensor([3, 50]))
    load.landed.fired = True
    assert not loader.landing(torch.tensor([3, 50]))


def test_reset_forgets_loads_no_batch_took():
    pool, host = pools()
    loader = LayerwiseLoader(pool, streams=FakeStreams())
    loader.stage(host, torch.arange(1, 5), torch.arange(1, 5))
    loader.reset()
    assert loader.take() == [] and not loader.landing(torch.arange(1, 5))


def test_copier_without_a_forward_pass_lands_at_once_and_backs_up_every_layer():
    pool, host = pools()
    fake = FakeStreams()
    copier = CudaStreamCopier(LayerwiseLoader(pool, streams=fake), deferred=False)
    copier.to_device(host, torch.arange(10, 20), pool, torch.arange(1, 11))
    for layer in range(LAYERS):
        assert torch.equal(pool.k_buffer[layer][1:11], host.k_buffer[layer][10:20])
    assert fake.log[-1][0] == "synchronize" and copier.loader.take() == []
    # back up into scattered host slots (the bounce-buffer path) and into one run
    for dst in (torch.tensor([60, 3, 41, 7, 22, 5, 9, 30, 33, 50]), torch.arange(50, 60)):
        copier.to_host(pool, torch.arange(1, 11), host, dst)
        for layer in range(LAYERS):
            assert torch.equal(host.k_buffer[layer][dst], pool.k_buffer[layer][1:11])
            assert torch.equal(host.v_buffer[layer][dst], pool.v_buffer[layer][1:11])


# ---------------------------------------------------------------------------- the forward pass
TINY = "tiny-layerwise-test"


@pytest.fixture(scope="module")
def runner():
    from phloem.runtime.executor.model_runner import ModelRunner
    from phloem.runtime.model_files import ModelSource
    from phloem.runtime.models.config import DUMMY_SHAPES, ModelConfig

    DUMMY_SHAPES[TINY] = ModelConfig(
        arch="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=LAYERS,
        num_heads=4, num_kv_heads=HEADS, head_dim=16, context_len=256,
    )  # fmt: skip
    try:
        return ModelRunner(ModelSource("dummy", TINY), dtype="float32", device="cpu", max_total_tokens=256,
                           max_running_requests=4, cpu_threads=1)  # fmt: skip
    finally:
        del DUMMY_SHAPES[TINY]


def extend_input(row: int, token: int, position: int, slot: int):
    from phloem.runtime.executor.model_runner import greedy_sampling_info

    one = torch.tensor([1])
    return ForwardInput(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor([token]),
        positions=torch.tensor([position]),
        out_slots=torch.tensor([slot]),
        req_pool_indices=torch.tensor([row]),
        seq_lens=torch.tensor([position + 1]),
        prefix_lens=torch.tensor([position]),
        extend_lens=one,
        sampling=greedy_sampling_info(1),
    )


def test_attention_of_each_layer_finds_that_layer_of_the_load_and_no_more(runner):
    """A prefix computed once, copied to the host, loaded into other slots during the next forward
    pass: each attention layer waited for its layer's copy and found that layer (and only the layers
    up to it) in the pool, and the pass gives the logits of the original."""
    from phloem.runtime.executor.model_runner import DirectBatcher

    fake = FakeStreams()
    runner.kv_loader = LayerwiseLoader(runner.kv_pool, streams=fake)
    batcher = DirectBatcher(runner)
    prompt = [(7 * i + 3) % 96 for i in range(20)]
    seq = batcher.new_sequence()
    batcher.logits({seq: prompt})  # prefix KV at slots 1..20
    reference = batcher.logits({seq: [5]})  # next-token logits with the prefix in place
    host = HostKVPool.like(runner.kv_pool, 64)
    KVCopier().to_host(runner.kv_pool, torch.arange(1, 21), host, torch.arange(30, 50))

    moved = torch.arange(100, 120)  # where the load lands; NaN until then
    for layer in range(LAYERS):
        runner.kv_pool.k_buffer[layer][moved] = float("nan")
        runner.kv_pool.v_buffer[layer][moved] = float("nan")
    row = runner.req_to_token_pool.alloc()
    runner.req_to_token_pool.req_to_token[row, :20] = moved
    runner.req_to_token_pool.req_to_token[row, 20] = 120
    load = runner.kv_loader.stage(host, torch.arange(30, 50), moved)
    copied = [e.id for e in load.copied]

    attn = runner.attn_backend
    seen = []
    original = attn.forward_extend

    def logged(q, k, v, layer):
        in_pool = [bool(torch.isfinite(runner.kv_pool.k_buffer[i][moved]).all()) for i in range(LAYERS)]
        seen.append((attn.layer_ready is not None, in_pool))
        fake.log.append(("attention", layer))
        return original(q, k, v, layer)

    attn.forward_extend = logged
    try:
        fake.log.clear()
        out = runner.forward(extend_input(row, 5, 20, 120), kv_loads=runner.kv_loader.take())
        log = list(fake.log)
        fake.log.clear()
        plain = runner.forward(extend_input(row, 5, 20, 120))  # nothing pending: nothing waits
        assert fake.log == [("attention", layer) for layer in range(LAYERS)]
    finally:
        del attn.forward_extend
        runner.kv_loader = None
    expected = []
    for layer in range(LAYERS):
        expected += [("wait", "compute", copied[layer]), ("attention", layer)]
    assert log == [*expected, ("record", "compute", load.landed.id)]
    assert seen[:LAYERS] == [(True, [i <= layer for i in range(LAYERS)]) for layer in range(LAYERS)]
    assert seen[LAYERS:] == [(False, [True] * LAYERS)] * LAYERS and attn.layer_ready is None
    assert out.synchronize() == plain.synchronize() == [int(reference.argmax())]
    torch.testing.assert_close(
        runner.forward_logits(extend_input(row, 5, 20, 120)), reference, rtol=0, atol=0
    )


# ---------------------------------------------------------------------------- hand-off by the worker
class RecordingRunner:
    """Records the loads each forward pass receives; the first pass blocks until released."""

    def __init__(self, loader: LayerwiseLoader) -> None:
        self.kv_loader = loader
        self.received: list[list] = []
        self.started, self.release = threading.Event(), threading.Event()

    def forward(self, fi, kv_loads=()) -> ForwardOutput:
        if not self.received:
            self.started.set()
            assert self.release.wait(10)
        self.received.append(list(kv_loads))
        out = torch.zeros(fi.batch_size, dtype=torch.int64)
        return ForwardOutput(next_token_ids=out, next_token_ids_cpu=out)


def dummy_input():
    return extend_input(0, 1, 0, 1)


@pytest.mark.parametrize("overlap", [False, True])
def test_loads_staged_after_a_step_was_launched_go_with_the_next_step(overlap):
    pool, host = pools()
    loader = LayerwiseLoader(pool, streams=FakeStreams())
    runner = RecordingRunner(loader)
    worker = (OverlapWorker if overlap else InlineWorker)(runner, FutureMap(8))
    if not overlap:
        runner.release.set()
    first = worker.submit(dummy_input(), None)
    if overlap:
        assert runner.started.wait(10)  # step 1 is running, its loads were taken at submit
    load = loader.stage(host, torch.arange(1, 5), torch.arange(1, 5))
    runner.release.set()
    second = worker.submit(dummy_input(), None)
    first.result(10), second.result(10)
    worker.close()
    assert runner.received == [[], [load]]


def test_controller_skips_backing_up_kv_that_has_not_landed():
    from tests.unit.test_hicache import Setup, seq

    class Landing(KVCopier):
        def landing(self, dev_slots):
            return True

    s = Setup(policy="write_through_selective")  # no copy at the first hit
    s.run(seq(100, 20))
    node = s.cm.match(seq(100, 20)).node
    s.hc.copier = Landing()
    assert not s.hc.backup_node(node) and node.tier == "device"
    s.cm.check_integrity()


def test_a_registered_loader_is_found_by_its_pool_while_it_lives():
    pool, _ = pools()
    assert LayerwiseLoader.registered(pool) is None
    loader = LayerwiseLoader.register(pool, streams=FakeStreams())
    assert LayerwiseLoader.registered(pool) is loader
    assert LayerwiseLoader.registered(pools()[0]) is None
    del loader
    assert LayerwiseLoader.registered(pool) is None
