"""Releasing the weights and the KV pool frees their device memory; resuming brings it back, with
the decode (and chain decode) CUDA graphs captured again over the new addresses and greedy output
unchanged."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_release_and_resume_on_cuda_with_graphs() -> None:
    from phloem.runtime.executor.memory_occupation import MemoryOccupation
    from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
    from phloem.runtime.model_files import resolve_model

    runner = ModelRunner(
        resolve_model("smollm2-135m", "dummy"), dtype="bfloat16", device="cuda",
        max_total_tokens=65536, max_running_requests=16, context_len=2048, chain_width=8,
    )  # fmt: skip
    assert runner.cuda_graphs is not None and runner.cuda_graphs.graphs
    assert runner.chain_decoder is not None and runner.chain_decoder.graphs
    batcher = DirectBatcher(runner)
    prompt = list(range(1000, 1032))
    before = batcher.generate_greedy(prompt, 24)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    kv_bytes = runner.kv_pool.bytes_per_token * runner.kv_pool.num_slots
    weight = next(runner.model.parameters())

    mem = MemoryOccupation(runner)
    mem.release(["kv_cache", "weights"])
    torch.cuda.synchronize()
    assert not runner.cuda_graphs.graphs  # dropped: they read the old addresses
    assert not runner.chain_decoder.graphs
    assert weight.untyped_storage().nbytes() == 0
    assert allocated - torch.cuda.memory_allocated() >= 0.9 * (runner.weight_bytes + kv_bytes)

    mem.resume(["weights", "kv_cache"])
    torch.cuda.synchronize()
    assert runner.cuda_graphs.graphs  # captured again
    assert runner.chain_decoder.graphs
    assert abs(torch.cuda.memory_allocated() - allocated) <= 0.05 * allocated
    assert weight.untyped_storage().nbytes() > 0
    assert batcher.generate_greedy(prompt, 24) == before
