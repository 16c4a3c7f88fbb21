"""How the scheduler process runs a weight update: only once no request runs, with requests that
arrive meanwhile held until after it, running requests aborted first with ``abort_all_requests``,
the prefix cache flushed afterwards, and engine faults answered without their details."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.messages import AbortReq, ControlReply, TokenizedGenerateReq, UpdateWeightsReq
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.scheduler.process import SchedulerProcess


class FakeScheduler:
    def __init__(self, running: list[str]) -> None:
        self.running = list(running)
        self.events: list[str] = []
        self.released: set[str] = set()  # memory given back (none here)

    @property
    def is_idle(self) -> bool:
        return not self.running

    def step(self) -> None:
        """One request finishes per step."""
        if self.running:
            self.events.append(f"finished {self.running.pop(0)}")

    def abort(self, rid: str | None, *, abort_all: bool = False, **kw: Any) -> None:
        self.events.append("abort all" if abort_all else f"abort {rid}")
        self.running = [r for r in self.running if not (abort_all or r == rid)]

    def flush_cache(self) -> bool:
        self.events.append("flush")
        return self.is_idle


class FakeRunner:
    def __init__(self, events: list[str], fail: Exception | None = None) -> None:
        self.events, self.fail = events, fail
        self.model_source = SimpleNamespace(path="/new/model")

    def update_source(self, model_path: str, load_format: str | None) -> None:
        from phloem.runtime.executor.weight_update import check_load_format

        check_load_format(load_format)

    def update_weights_from_disk(self, model_path: str, load_format: str | None) -> str:
        self.events.append(f"update {model_path}")
        if self.fail is not None:
            raise self.fail
        return "loaded"


def make_proc(running: list[str], fail: Exception | None = None) -> tuple[SchedulerProcess, list[Any]]:
    proc = object.__new__(SchedulerProcess)
    sched = FakeScheduler(running)
    proc.scheduler = sched  # type: ignore[assignment]
    proc.rt = SimpleNamespace(runner=FakeRunner(sched.events, fail))
    proc._weight_updates, proc._held, proc._tensors = [], [], {}
    sent: list[Any] = []
    proc._send_tm = sent.append  # type: ignore[method-assign]
    proc._admit = lambda msg: sched.events.append(f"admit {msg.rid}")  # type: ignore[method-assign]
    return proc, sent


def generate(rid: str) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid=rid, input_ids=[1], sampling_params=SamplingParams())


def run_until_idle(proc: SchedulerProcess) -> None:
    """What the loop does after each step."""
    for _ in range(10):
        proc.scheduler.step()
        if proc._weight_updates and proc.scheduler.is_idle:
            proc._run_weight_updates()


def test_update_waits_for_running_requests_and_holds_new_ones():
    proc, sent = make_proc(running=["a", "b"])
    proc._on_update_weights(UpdateWeightsReq(req_id=7, model_path="/m"))
    proc._on_generate(generate("c"))
    assert sent == [] and "admit c" not in proc.scheduler.events  # type: ignore[attr-defined]
    run_until_idle(proc)
    assert proc.scheduler.events == ["finished a", "finished b", "update /m", "flush", "admit c"]  # type: ignore[attr-defined]
    assert sent == [ControlReply(req_id=7, ok=True, message="loaded", data={"model_path": "/new/model"})]


def test_abort_all_requests_aborts_running_ones_first():
    proc, sent = make_proc(running=["a", "b"])
    proc._on_update_weights(UpdateWeightsReq(req_id=1, model_path="/m", abort_all_requests=True))
    run_until_idle(proc)
    assert proc.scheduler.events == ["abort all", "update /m", "flush"]  # type: ignore[attr-defined]
    assert sent[0].ok


def test_aborting_a_held_request_admits_it_to_be_aborted():
    proc, _ = make_proc(running=["a"])
    proc._on_update_weights(UpdateWeightsReq(req_id=1, model_path="/m"))
    proc._on_generate(generate("c"))
    proc._on_generate(generate("d"))
    proc._on_abort(AbortReq(rid="c"))
    assert proc.scheduler.events == ["admit c", "abort c"]  # type: ignore[attr-defined]
    assert [m.rid for m in proc._held] == ["d"]


def test_refusal_names_the_field_and_a_fault_stays_in_the_log(caplog):
    proc, sent = make_proc(running=[], fail=InvalidRequest("model_path", "no such file: /m"))
    proc._on_update_weights(UpdateWeightsReq(req_id=1, model_path="/m"))
    run_until_idle(proc)
    refusal = ControlReply(req_id=1, ok=False, message="model_path: no such file: /m", data={"field": "model_path"})
    assert sent == [refusal]
    proc, sent = make_proc(running=[], fail=RuntimeError("secret detail"))
    proc._on_update_weights(UpdateWeightsReq(req_id=2, model_path="/m"))
    run_until_idle(proc)
    assert sent == [ControlReply(req_id=2, ok=False, message="internal error", data={"internal": True})]
    assert "secret detail" in caplog.text  # the traceback is logged server-side
    assert proc.scheduler.events[-1] == "flush"  # type: ignore[attr-defined]


def test_a_hopeless_update_is_refused_before_anything_waits_or_is_aborted():
    proc, sent = make_proc(running=["a"])
    proc._on_update_weights(UpdateWeightsReq(req_id=3, model_path="/m", load_format="pt", abort_all_requests=True))
    assert sent[0].ok is False and sent[0].data == {"field": "load_format"}
    assert proc.scheduler.events == [] and proc._weight_updates == []  # type: ignore[attr-defined]


def test_tensors_are_checked_on_arrival_and_applied_when_idle():
    from safetensors.torch import save

    from tests.unit.tiny_model import tiny_runner

    proc, sent = make_proc(running=["a"])
    runner = tiny_runner()
    proc.rt = SimpleNamespace(runner=runner)
    bad = save({"model.layers.9.mlp.up_proj.weight": torch.zeros(2)})
    proc._on_update_weights(UpdateWeightsReq(req_id=4, tensor_data=bad, tensor_field="safetensors_b64", abort_all_requests=True))
    assert sent[0].data == {"field": "safetensors_b64"} and "layers.9" in sent[0].message
    assert proc.scheduler.events == []  # type: ignore[attr-defined]
    good = save({"model.norm.weight": torch.full((64,), 2.0)})
    proc._on_update_weights(UpdateWeightsReq(req_id=5, tensor_data=good))
    assert not torch.equal(runner.model.model.norm.weight, torch.full((64,), 2.0))  # not while "a" runs
    run_until_idle(proc)
    assert sent[1] == ControlReply(req_id=5, ok=True, message="updated 1 tensors")
    assert torch.equal(runner.model.model.norm.weight, torch.full((64,), 2.0)) and proc._tensors == {}


def test_a_fault_while_checking_is_answered_not_raised(caplog):
    proc, sent = make_proc(running=["a"])

    def explode(*args: Any) -> None:
        raise RuntimeError("secret detail")

    proc.rt.runner.update_source = explode
    proc._on_update_weights(UpdateWeightsReq(req_id=6, model_path="/m", abort_all_requests=True))
    assert sent == [ControlReply(req_id=6, ok=False, message="internal error", data={"internal": True})]
    assert "secret detail" in caplog.text and proc._weight_updates == []


def test_a_broadcast_update_is_refused_before_receiving_and_queued_once_received():
    """A bad broadcast update is answered at once, nothing aborted; a received one is applied
    when idle like any tensor update, and ``flush_cache: false`` keeps the prefix cache."""
    from phloem.runtime.messages import UpdateWeightsFromDistributedReq
    from phloem.runtime.scheduler.weight_sync import Finished, WeightSync

    from tests.unit.tiny_model import tiny_runner

    proc, sent = make_proc(running=["a"])
    runner = tiny_runner()
    proc.rt = SimpleNamespace(runner=runner)
    proc.weight_sync = WeightSync(torch.device("cpu"))
    body = dict(names=["model.norm.weight"], dtypes=["float32"], shapes=[[64]], abort_all_requests=True)
    proc._on_group_request(UpdateWeightsFromDistributedReq(req_id=7, group_name="none", **body))
    assert sent[0].data == {"field": "group_name"} and proc.scheduler.events == []  # type: ignore[attr-defined]

    msg = UpdateWeightsFromDistributedReq(req_id=8, flush_cache=False, **body)
    proc._on_group_job_done(Finished(msg, result={"model.norm.weight": torch.full((64,), 3.0)}))
    assert len(sent) == 1  # answered only once applied
    run_until_idle(proc)
    assert sent[1] == ControlReply(req_id=8, ok=True, message="updated 1 tensors")
    assert torch.equal(runner.model.model.norm.weight, torch.full((64,), 3.0))
    assert "flush" not in proc.scheduler.events  # type: ignore[attr-defined]

    failed = Finished(UpdateWeightsFromDistributedReq(req_id=9, **body), error=RuntimeError("peer closed"))
    proc._on_group_job_done(failed)
    assert sent[2].ok is False and sent[2].data == {"field": "group_name"} and "peer closed" in sent[2].message


def test_reading_weights_back_names_the_field_and_is_refused_while_they_are_released():
    from phloem.runtime.errors import InvalidRequest
    from phloem.runtime.messages import GetWeightsReq

    def unknown(name: str) -> Any:
        raise InvalidRequest("name", f"no weight named {name!r}")

    proc, sent = make_proc(running=[])
    proc.rt.runner.model = SimpleNamespace(checkpoint_target=unknown)
    proc._on_get_weights(GetWeightsReq(req_id=1, name="no.such.weight", truncate_size=2))
    assert not sent[-1].ok and sent[-1].data.get("field") == "name"
    proc.scheduler.released = {"weights"}  # type: ignore[attr-defined]
    proc._on_get_weights(GetWeightsReq(req_id=2, name="model.norm.weight", truncate_size=2))
    assert not sent[-1].ok and "released" in sent[-1].message
