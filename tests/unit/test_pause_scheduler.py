"""pause_generation / continue_generation and release / resume of device memory at the scheduler:
what each pause mode does to running and waiting requests, that nothing is launched while paused
or released, that requests sent meanwhile wait, that a release is refused while a request holds
KV, and that a weight update runs while requests are paused instead of waiting for them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from phloem.runtime.executor.memory_occupation import MemoryOccupation
from phloem.runtime.messages import (
    ContinueGenerationReq,
    ControlReply,
    MemoryOccupationReq,
    PauseGenerationReq,
    UpdateWeightsReq,
)
from phloem.runtime.scheduler.process import SchedulerProcess

from tests.unit.test_scheduler_loop import Harness, expected

PROMPT = list(range(100, 120))


def steps(h: Harness, n: int) -> None:
    for _ in range(n):
        h.s.step()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_paused_requests_continue_with_no_token_lost_or_repeated(overlap, mode):
    h = Harness(pool=4096, overlap=overlap)
    a = h.add("a", PROMPT, max_new=30)
    steps(h, 6)
    h.s.pause(mode)
    assert not h.s.inflight and 0 < len(a.output_ids) < 30
    if mode == "retract":
        assert h.s.waiting == [a] and not h.s.holds_kv and a.num_retractions == 1
        assert h.cache.free_size + h.cache.evictable_size == h.cache.total_size  # its KV was given back
    else:
        assert h.s.running == [a] and h.s.holds_kv
    done, launched = len(a.output_ids), h.runner.steps
    b = h.add("b", list(range(300, 310)), max_new=5)  # arrives while paused: waits
    for _ in range(5):
        assert h.s.step() is False
    assert h.runner.steps == launched and len(a.output_ids) == done and not b.output_ids
    h.s.resume()
    h.run()
    assert h.outputs() == {"a": expected(20, 30), "b": expected(10, 5)}


@pytest.mark.parametrize("overlap", [False, True])
def test_retract_mid_chunked_prompt(overlap):
    h = Harness(pool=4096, overlap=overlap, chunk=16)
    h.add("long", list(range(200, 300)), max_new=5)
    steps(h, 2)
    h.s.pause("retract")
    assert h.s.chunked is None and not h.s.holds_kv
    h.s.resume()
    h.run()
    assert h.outputs()["long"] == expected(100, 5)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_mode_ends_running_and_waiting_requests_as_caller_aborts(overlap):
    h = Harness(pool=4096, overlap=overlap, max_running=1)
    h.add("a", PROMPT, max_new=30)
    steps(h, 4)
    h.add("b", list(range(300, 310)), max_new=5)  # waits behind a (one row)
    h.s.pause("abort")
    finished = h.finished()
    assert set(finished) == {"a", "b"}
    assert all(f["type"] == "abort" and f.get("status_code") is None for f in finished.values())
    assert h.s.is_idle and h.s.paused
    h.add("c", list(range(400, 410)), max_new=3)
    assert h.s.step() is False
    h.s.resume()
    h.run()
    assert h.outputs()["c"] == expected(10, 3)


# ---- the scheduler process: control messages ------------------------------------------------------
class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)


def make_proc(h: Harness) -> tuple[SchedulerProcess, list[Any], Any]:
    """A scheduler process around the harness's scheduler, with a stand-in runner whose weights and
    KV buffers are real tensors (the fake model computes tokens from positions)."""
    proc = object.__new__(SchedulerProcess)
    proc.scheduler = h.s
    updates: list[str] = []
    runner = SimpleNamespace(
        model=TinyModel(),
        device=torch.device("cpu"),
        kv_pool=SimpleNamespace(k_buffer=[torch.ones(16, 2, 4)], v_buffer=[torch.ones(16, 2, 4)]),
        cuda_graphs=None,
        update_source=lambda path, fmt: None,
        update_weights_from_disk=lambda path, fmt: updates.append(path) or "loaded",
        model_source=SimpleNamespace(path="/new"),
    )
    proc.rt = SimpleNamespace(runner=runner)
    proc._weight_updates, proc._held, proc._tensors = [], [], {}
    proc._flush_pending, proc._memory = False, None
    sent: list[Any] = []
    proc._send_tm = sent.append  # type: ignore[method-assign]
    return proc, sent, SimpleNamespace(runner=runner, updates=updates)


def test_release_is_refused_while_a_request_holds_kv_and_waits_for_resume():
    h = Harness(pool=4096, overlap=False)
    h.add("a", PROMPT, max_new=20)
    steps(h, 3)
    proc, sent, rt = make_proc(h)
    proc._on_pause(PauseGenerationReq(req_id=1, mode="in_place"))
    proc._on_memory(MemoryOccupationReq(req_id=2, release=True, tags=["kv_cache", "weights"]))
    assert sent[-1].ok is False and "pause generation" in sent[-1].message and sent[-1].data == {"field": "tags"}
    assert h.s.released == set()

    proc._on_pause(PauseGenerationReq(req_id=3, mode="retract"))  # now nothing holds KV
    proc._on_memory(MemoryOccupationReq(req_id=4, release=True, tags=["kv_cache", "weights"]))
    assert sent[-1].ok, sent[-1]
    weight, kv = rt.runner.model.proj.weight, rt.runner.kv_pool.k_buffer[0]
    assert weight.untyped_storage().nbytes() == 0 and kv.untyped_storage().nbytes() == 0
    assert h.cache.evictable_size == 0  # the prefix cache was flushed with the pool
    assert h.s.live_stats()["kv_cache_released"] == 1.0

    proc._on_continue(ContinueGenerationReq(req_id=5))
    assert h.s.stopped and h.s.step() is False  # still released: nothing runs
    proc._on_update_weights(UpdateWeightsReq(req_id=6, model_path="/m"))
    assert sent[-1] == ControlReply(
        req_id=6, ok=False, message="the weights are released: resume memory occupation of 'weights' first"
    )
    proc._on_memory(MemoryOccupationReq(req_id=7, release=False, tags=["kv_cache", "weights"]))
    assert sent[-1].ok and not h.s.stopped
    assert weight.untyped_storage().nbytes() == 8 * 8 * 4 and kv.untyped_storage().nbytes() > 0
    h.run()
    assert h.outputs()["a"] == expected(20, 20)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_weight_update_runs_while_requests_are_paused(mode):
    h = Harness(pool=4096, overlap=True)
    h.add("a", PROMPT, max_new=20)
    steps(h, 4)
    proc, sent, rt = make_proc(h)
    proc._on_pause(PauseGenerationReq(req_id=1, mode=mode))
    proc._on_update_weights(UpdateWeightsReq(req_id=2, model_path="/m"))
    proc.after_step()  # what the loop does after each (here: skipped) step
    assert rt.updates == ["/m"] and sent[-1].ok
    # retracted: nothing holds KV, the cache is flushed now; in place: once the request is done
    assert proc._flush_pending == (mode == "in_place")
    if mode == "retract":
        assert h.cache.evictable_size == 0  # what a computed before the update is gone
    proc._on_continue(ContinueGenerationReq(req_id=3))
    h.run()
    if mode == "in_place":
        assert h.cache.evictable_size > 0
        proc.after_step()
        assert not proc._flush_pending and h.cache.evictable_size == 0
    assert h.outputs()["a"] == expected(20, 20)


def test_unknown_mode_or_tag_is_refused_naming_the_field():
    h = Harness(pool=4096, overlap=False)
    proc, sent, _ = make_proc(h)
    proc._on_pause(PauseGenerationReq(req_id=1, mode="later"))
    proc._on_memory(MemoryOccupationReq(req_id=2, release=True, tags=["activations"]))
    assert [(m.ok, m.data) for m in sent] == [(False, {"field": "mode"}), (False, {"field": "tags"})]
    assert not h.s.stopped


def test_update_queued_before_a_release_is_applied_before_the_weights_leave():
    h = Harness(pool=4096, overlap=False)
    h.add("a", PROMPT, max_new=20)
    steps(h, 3)
    proc, sent, rt = make_proc(h)
    proc._on_update_weights(UpdateWeightsReq(req_id=1, model_path="/m"))  # waits for a
    proc._on_pause(PauseGenerationReq(req_id=2, mode="retract"))
    proc._on_memory(MemoryOccupationReq(req_id=3, release=True, tags=["weights"]))
    assert rt.updates == ["/m"] and [m.req_id for m in sent] == [2, 1, 3] and all(m.ok for m in sent)
    assert h.s.released == {"weights"}


def test_memory_occupation_keeps_tensor_objects_and_values():
    model = TinyModel()
    model.tied = model.proj.weight  # one storage reached twice is saved once
    runner = SimpleNamespace(
        model=model, device=torch.device("cpu"), cuda_graphs=None,
        kv_pool=SimpleNamespace(k_buffer=[torch.ones(4, 2)], v_buffer=[torch.ones(4, 2)]),
    )  # fmt: skip
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mem = MemoryOccupation(runner)
    assert "weights" in mem.release(["weights"]) and mem.released == {"weights"}
    assert mem.release(["weights"]) == "nothing to release"
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    mem.resume(["weights", "kv_cache"])
    assert mem.released == set()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    with pytest.raises(ValueError, match="unknown memory tag"):
        mem.release(["activations"])
