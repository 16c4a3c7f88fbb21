"""Weight broadcasts and reading weights back, below HTTP: the checks made before anything is
received, a real gloo group of two ranks (threads of this process), the scheduler's group thread,
the Hugging Face name mapping of ``weight_values``, and the shared-memory tensor file."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.executor.weight_group import (
    TensorSpec,
    check_broadcast_update,
    check_group_request,
    join_group,
    parse_dtype,
)
from phloem.runtime.executor.weight_update import model_tensors, weight_values
from phloem.runtime.messages import (
    DestroyWeightsGroupReq,
    InitWeightsGroupReq,
    UpdateWeightsFromDistributedReq,
)
from phloem.runtime.scheduler.weight_sync import WeightSync
from phloem.runtime.shm_tensors import shared_dir, shared_safetensors

from tests.integration.conftest import free_port
from tests.unit.test_weight_update import hf_checkpoint
from tests.unit.tiny_model import tiny_runner

Q = "model.layers.0.self_attn.q_proj.weight"
UP = "model.layers.0.mlp.up_proj.weight"
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def runner():
    return tiny_runner()


def refused(field: str, fn, *args) -> str:
    with pytest.raises(InvalidRequest) as e:
        fn(*args)
    assert e.value.field == field, e.value
    return e.value.message


# ---- checks before anything is received ----------------------------------------------------------
def test_broadcast_update_is_checked_against_the_model(runner):
    model = runner.model
    ckpt = hf_checkpoint(model)
    shape = list(ckpt[Q].shape)
    specs = check_broadcast_update(model, [Q, NORM], ["bfloat16", "torch.float32"], [shape, list(ckpt[NORM].shape)])
    assert specs == [
        TensorSpec(Q, torch.bfloat16, tuple(shape)),
        TensorSpec(NORM, torch.float32, tuple(ckpt[NORM].shape)),
    ]
    assert "nope" in refused("names", check_broadcast_update, model, ["model.nope.weight"], ["float32"], [[3]])
    assert "does not match" in refused("shapes", check_broadcast_update, model, [Q], ["float32"], [[shape[0] + 1, shape[1]]])
    refused("dtypes", check_broadcast_update, model, [Q], ["int8"], [shape])
    refused("dtypes", check_broadcast_update, model, [Q, NORM], ["float32"], [shape, [1]])
    refused("shapes", check_broadcast_update, model, [Q], ["float32"], [])
    refused("names", check_broadcast_update, model, [], [], [])
    assert "twice" in refused("names", check_broadcast_update, model, [Q, Q], ["float32"] * 2, [shape] * 2)


def test_group_request_checks_name_the_field():
    cpu = torch.device("cpu")
    ok = dict(master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=2, group_name="g", backend="gloo")
    check_group_request(**ok, device=cpu)
    for field, value in (
        ("master_address", ""),
        ("master_port", 0),
        ("world_size", 1),
        ("rank_offset", 2),
        ("rank_offset", 0),
        ("group_name", ""),
        ("backend", "mpi"),
        ("backend", "nccl"),  # the model is on the CPU
    ):
        refused(field, lambda v=value, f=field: check_group_request(**{**ok, f: v}, device=cpu))
    assert parse_dtype("torch.float16") is torch.float16


# ---- reading weights back under Hugging Face names -----------------------------------------------
def test_weight_values_map_fused_parts(runner):
    model = runner.model
    ckpt = hf_checkpoint(model)
    for name in (Q, "model.layers.0.self_attn.v_proj.weight", UP, NORM):
        full = weight_values(model, name, 10**9)
        assert torch.equal(torch.tensor(full), ckpt[name]), name
        head = weight_values(model, name, 3)
        assert torch.equal(torch.tensor(head), ckpt[name][:3])
    assert weight_values(model, NORM, 0) == []
    refused("name", weight_values, model, "model.nope.weight", 5)
    refused("truncate_size", weight_values, model, NORM, -1)


# ---- a real gloo group ---------------------------------------------------------------------------
def test_gloo_group_broadcasts_in_order():
    port = free_port()
    got: dict = {}

    def server() -> None:
        group = join_group("127.0.0.1", port, 1, 2, "unit_group", "gloo")
        got.update(group.receive([TensorSpec("a", torch.float32, (3, 4)), TensorSpec("b", torch.bfloat16, (5,))]))
        group.close()

    thread = threading.Thread(target=server)
    thread.start()
    trainer = join_group("127.0.0.1", port, 0, 2, "unit_group", "gloo")
    a, b = torch.randn(3, 4), torch.randn(5, dtype=torch.bfloat16)
    trainer.send([a, b])
    thread.join(timeout=60)
    trainer.close()
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)


def wait_finished(sync: WeightSync, timeout: float = 60.0) -> list:
    deadline = time.time() + timeout
    done: list = []
    while sync.pending and time.time() < deadline:
        done += sync.finished()
        time.sleep(0.01)
    return done + sync.finished()


def test_scheduler_side_joins_receives_and_refuses_before_receiving(runner):
    """The group thread joins and receives while the caller keeps running; a bad update is
    refused at once (nothing waits on the trainer) and the received tensors are not yet applied."""
    model = runner.model
    before = {k: v.clone() for k, v in model_tensors(model).items()}
    port = free_port()
    sync = WeightSync(torch.device("cpu"))
    sync.start_join(
        InitWeightsGroupReq(req_id=1, master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
                            group_name="g", backend="gloo")  # fmt: skip
    )
    assert sync.pending  # joining waits for the trainer on the group thread
    trainer = join_group("127.0.0.1", port, 0, 2, "g", "gloo")
    [joined] = wait_finished(sync)
    assert joined.error is None and "g" in sync.groups
    # a second join of the same name, and updates naming a bad group, name or shape: refused now
    refused("group_name", sync.start_join, InitWeightsGroupReq(
        req_id=2, master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name="g",
        backend="gloo"))  # fmt: skip
    shape = list(hf_checkpoint(model)[UP].shape)
    for field, msg in (
        ("group_name", UpdateWeightsFromDistributedReq(req_id=3, names=[UP], dtypes=["float32"], shapes=[shape], group_name="x")),
        ("names", UpdateWeightsFromDistributedReq(req_id=3, names=["nope"], dtypes=["float32"], shapes=[shape], group_name="g")),
        ("shapes", UpdateWeightsFromDistributedReq(req_id=3, names=[UP], dtypes=["float32"], shapes=[[1, 1]], group_name="g")),
    ):  # fmt: skip
        refused(field, sync.start_receive, msg, model)
    assert not sync.pending

    new = torch.randn(shape)
    sync.start_receive(
        UpdateWeightsFromDistributedReq(req_id=4, names=[UP], dtypes=["float32"], shapes=[shape], group_name="g"), model
    )
    trainer.send([new])
    [received] = wait_finished(sync)
    assert received.error is None and torch.equal(received.result[UP], new)
    for name, value in model_tensors(model).items():
        assert torch.equal(value, before[name]), name  # receiving writes nothing into the model

    sync.start_destroy(DestroyWeightsGroupReq(req_id=5, group_name="g"))
    assert "g" not in sync.groups
    [left] = wait_finished(sync)
    assert left.error is None
    trainer.close()


# ---- tensors through shared memory ---------------------------------------------------------------
def test_shared_safetensors_file_is_removed_after_use():
    from safetensors.torch import load_file

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = [("a", base), ("a_row", base[1])]  # views of one storage are written as copies
    with shared_safetensors(tensors) as path:
        if shared_dir() is not None:
            assert path.startswith(shared_dir())
        back = load_file(path)
        assert torch.equal(back["a"], base) and torch.equal(back["a_row"], base[1])
    assert not os.path.exists(path)


def test_cuda_ipc_tensors_are_refused_without_cuda():
    from phloem.runtime.cuda_ipc import open_shared, share
    from phloem.runtime.messages import CudaIpcTensor

    spec = CudaIpcTensor(name=UP, size=[2], stride=[1], offset=0, dtype="float32", device=0, handle=b"h",
                         storage_size=8, storage_offset=0, ref_counter_handle=b"r", ref_counter_offset=0)  # fmt: skip
    if not torch.cuda.is_available():
        assert "no CUDA device" in refused("named_tensors", open_shared, spec)
    with pytest.raises(ValueError):
        share(UP, torch.zeros(2))  # a CPU tensor has no IPC handle


def test_a_trainer_built_on_torch_group_helpers_reaches_the_server_side():
    """A trainer that builds its group as SGLang's trainers do (a tcp:// rendezvous, the store
    prefixed with the group name, torch's named-group helper, ``dist.broadcast``) meets
    :func:`join_group` on the server's side."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not hasattr(c10d, "_new_process_group_helper"):
        pytest.skip("this torch has no named-group helper")
    port, name = free_port(), "torch_helper_group"
    got: dict = {}

    def server() -> None:
        group = join_group("127.0.0.1", port, 1, 2, name, "gloo", timeout_s=60)
        got.update(group.receive([TensorSpec("w", torch.float32, (2, 3))]))

    thread = threading.Thread(target=server)
    thread.start()
    timeout = timedelta(seconds=60)
    store, _, _ = next(c10d.rendezvous(f"tcp://127.0.0.1:{port}", rank=0, world_size=2, timeout=timeout))
    pg, _ = c10d._new_process_group_helper(
        2, 0, [], c10d.Backend("gloo"), c10d.PrefixStore(name, store), group_name=name, timeout=timeout
    )
    c10d._world.pg_group_ranks[pg] = {0: 0, 1: 1}  # what torch's helpers leave to their caller
    w = torch.randn(2, 3)
    dist.broadcast(w, src=0, group=pg)
    thread.join(timeout=60)
    assert torch.equal(got["w"], w)
