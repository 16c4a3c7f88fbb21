"""Releasing memory drops every graph set the runner holds (they captured the old addresses) and
resuming captures each again: the decode graphs, the short extend graphs and the chain decode
graphs (``executor/memory_occupation.py``). The CUDA side is ``tests/kernels/
test_memory_occupation_cuda.py``; here a small CPU model and recording graph sets."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from phloem.runtime.executor.memory_occupation import MemoryOccupation


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.graphs: dict = {1: object()}
        self.logits: dict = {}
        self.pool = None

    def drop(self) -> None:
        self.calls.append("drop")

    def capture(self) -> None:
        self.calls.append("capture")


def test_release_drops_and_resume_captures_every_graph_set() -> None:
    decode, extend, chain = Recorder(), Recorder(), Recorder()
    runner = SimpleNamespace(
        model=torch.nn.Linear(4, 4),
        device=torch.device("cpu"),
        cuda_graphs=decode,
        extend_graphs=extend,
        chain_decoder=chain,
        kv_pool=SimpleNamespace(k_buffer=[torch.zeros(8)], v_buffer=[torch.zeros(8)]),
    )
    mem = MemoryOccupation(runner)
    mem.release(["weights"])
    assert decode.graphs == {} and extend.calls == ["drop"] and chain.calls == ["drop"]
    mem.resume(["weights"])
    assert decode.calls == ["capture"] and extend.calls == ["drop", "capture"]
    assert chain.calls == ["drop", "capture"]


def test_a_runner_without_the_optional_graph_sets_releases_and_resumes() -> None:
    decode = Recorder()
    runner = SimpleNamespace(
        model=torch.nn.Linear(4, 4), device=torch.device("cpu"), cuda_graphs=decode, extend_graphs=None,
        kv_pool=SimpleNamespace(k_buffer=[torch.zeros(8)], v_buffer=[torch.zeros(8)]),
    )  # fmt: skip
    mem = MemoryOccupation(runner)
    mem.release(["weights", "kv_cache"])
    mem.resume(["weights", "kv_cache"])
    assert decode.calls == ["capture"]
