"""Rank placement, the rendezvous address, the follower's view of a step, and the flag checks."""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.config import EngineArgs
from phloem.runtime.distributed.ranks import init_method, node_ranks
from phloem.runtime.distributed.state import TPGroup, get_tp, shard_range
from phloem.runtime.executor.model_runner import greedy_sampling_info
from phloem.runtime.executor.tp_step import OnDevice, follower_view, table_width
from phloem.runtime.forward_io import ForwardInput, ForwardMode
from phloem.runtime.launch import check_parallel


def test_ranks_spread_evenly_over_nodes_in_node_order() -> None:
    places = node_ranks(8, 2, 1, base_gpu_id=2)
    assert [p.rank for p in places] == [4, 5, 6, 7]
    assert [p.local_rank for p in places] == [0, 1, 2, 3]
    assert [p.gpu for p in places] == [2, 3, 4, 5]
    assert all(p.size == 8 for p in places)
    assert [p.rank for p in node_ranks(3, 1, 0)] == [0, 1, 2]


def test_nodes_must_divide_ranks() -> None:
    with pytest.raises(ValueError, match="--nnodes 2 does not divide --tp-size 3"):
        node_ranks(3, 2, 0)


@pytest.mark.parametrize("addr", ["10.0.0.1", "10.0.0.1:", ":29500", "host:port", "h:70000"])
def test_malformed_rendezvous_address_is_named(addr: str) -> None:
    with pytest.raises(ValueError, match="--dist-init-addr"):
        init_method(addr)


def test_rendezvous_url() -> None:
    assert init_method("10.0.0.1:29500") == "tcp://10.0.0.1:29500"
    assert init_method("[fe80::1]:29500") == "tcp://[fe80::1]:29500"


def test_single_rank_group_collectives_are_identities() -> None:
    tp = get_tp()
    assert tp == TPGroup() and tp.is_driver
    x = torch.arange(4.0)
    assert tp.all_reduce(x) is x and tp.all_gather(x) is x and tp.broadcast(x) is x
    assert tp.broadcast_object({"a": 1}) == {"a": 1}


def test_shard_range_names_the_dimension() -> None:
    assert shard_range(9, 2, 3, what="attention heads") == (6, 9)
    with pytest.raises(ValueError, match="--tp-size 2 does not divide the model's 9 attention heads"):
        shard_range(9, 0, 2, what="attention heads")


def _decode_input(seq_lens: list[int], steps: int = 1) -> ForwardInput:
    b = len(seq_lens)
    lens = torch.tensor(seq_lens)
    return ForwardInput(
        mode=ForwardMode.DECODE, input_ids=torch.tensor([-5, -6, -7][:b]), positions=lens - 1,
        out_slots=torch.arange(b), req_pool_indices=torch.tensor([3, 1, 0][:b]), seq_lens=lens,
        prefix_lens=lens - 1, extend_lens=torch.ones(b, dtype=torch.int64),
        sampling=greedy_sampling_info(b).__class__(
            temperatures=torch.full((b,), 0.7), top_ps=torch.ones(b), top_ks=torch.full((b,), -1),
            min_ps=torch.zeros(b), vocab_mask=torch.ones(b, 8, dtype=torch.bool),
        ),
        decode_steps=steps,
    )  # fmt: skip


def test_followers_get_greedy_sampling_and_no_grammar_mask() -> None:
    fi = _decode_input([5, 9, 2])
    view, moved = follower_view(fi)
    assert moved == []  # host tensors travel inside the pickled step
    assert view.sampling.is_greedy_all and view.sampling.vocab_mask is None
    assert torch.equal(view.input_ids, fi.input_ids)  # futures stay futures: each rank resolves them
    assert fi.sampling.vocab_mask is not None  # rank 0's own step is untouched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device tensors need a GPU")
def test_device_fields_travel_as_tensors() -> None:
    fi = _decode_input([5, 9])
    fi.out_slots = fi.out_slots.cuda()
    view, moved = follower_view(fi)
    assert isinstance(view.out_slots, OnDevice) and len(moved) == 1 and moved[0] is fi.out_slots


def test_table_width_covers_the_longest_row_and_later_steps() -> None:
    assert table_width(_decode_input([5, 9, 2])) == 9
    assert table_width(_decode_input([5, 9, 2], steps=4)) == 12


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tp_size": 0}, "--tp-size must be >= 1"),
        ({"nnodes": 2, "tp_size": 2}, "--dist-init-addr"),
        ({"nnodes": 2, "tp_size": 3, "dist_init_addr": "h:1"}, "does not divide --tp-size 3"),
        ({"node_rank": 1}, "--node-rank 1"),
        ({"tp_size": 2, "speculative_algorithm": "NGRAM"}, "--speculative-algorithm is not available"),
        ({"tp_size": 2, "enable_hierarchical_cache": True}, "--enable-hierarchical-cache is not available"),
        ({"tp_size": 2, "dist_init_addr": "nohost"}, "expected HOST:PORT"),
        ({"dp_size": 2, "tp_size": 2, "nnodes": 2, "dist_init_addr": "h:1"}, "--dp-size runs its replicas"),
    ],
)
def test_parallel_flags_are_checked(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_parallel(EngineArgs(**changes))
    check_parallel(EngineArgs(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:29500"))


def test_cpu_ranks_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from phloem.runtime.scheduler.builder import cpu_threads_per_rank

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert cpu_threads_per_rank(EngineArgs()) is None  # one rank: every core (the runner's default)
    assert cpu_threads_per_rank(EngineArgs(tp_size=4)) == 4
    assert cpu_threads_per_rank(EngineArgs(tp_size=4, nnodes=2, dist_init_addr="h:1")) == 8
    assert cpu_threads_per_rank(EngineArgs(tp_size=32)) == 1
    assert cpu_threads_per_rank(EngineArgs(tp_size=4, cpu_threads=3)) == 3  # the flag wins


def test_tensor_parallel_ranks_compute_in_float_unless_told_int4_or_int8() -> None:
    from phloem.runtime.executor.model_runner import _resolve_quantization
    from phloem.runtime.model_files import resolve_model

    source = resolve_model(None, "auto")  # the default GGUF: auto means its blocks on one rank
    cpu = torch.device("cpu")
    assert _resolve_quantization("auto", cpu, source, torch.float32, tp_size=3) is None
    assert _resolve_quantization("int8", cpu, source, torch.float32, tp_size=3) == "int8"
    with pytest.raises(ValueError, match="--quantization gguf is not available with --tp-size"):
        _resolve_quantization("gguf", cpu, source, torch.float32, tp_size=3)
