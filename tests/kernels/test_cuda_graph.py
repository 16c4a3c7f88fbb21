"""Decode through captured CUDA graphs gives the eager logits; triton and torch_ref agree end to end."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def runner():
    from phloem.runtime.executor.model_runner import ModelRunner
    from phloem.runtime.model_files import resolve_model

    return ModelRunner(
        resolve_model("smollm2-135m", "dummy"),
        dtype="bfloat16", device="cuda", attention_backend="triton",
        max_total_tokens=8192, max_running_requests=16, context_len=1024,
    )  # fmt: skip


def test_capture_sizes() -> None:
    from phloem.runtime.executor.cuda_graph import capture_batch_sizes

    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_batch_sizes(64)[-3:] == [32, 48, 64]


def test_graph_replay_matches_eager_and_torch_ref(runner) -> None:
    from phloem.runtime.attention.registry import get_attention_backend_class
    from phloem.runtime.executor.cuda_graph import CudaGraphRunner
    from phloem.runtime.executor.model_runner import DirectBatcher

    batcher = DirectBatcher(runner)
    gen = torch.Generator().manual_seed(0)
    seqs = [batcher.new_sequence() for _ in range(5)]
    prompts = {
        s: torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist()
        for s, n in zip(seqs, [3, 40, 130, 7, 300])
    }
    prefill_logits = batcher.logits(prompts)  # triton extend over fresh rows
    graphs = CudaGraphRunner(runner.model, runner.attn_backend, max_bs=8)
    graphs.capture()
    assert graphs.capture_seconds > 0 and set(graphs.graphs) == {1, 2, 4, 8}

    fi = batcher.build({s: [int(t)] for s, t in zip(seqs, prefill_logits.argmax(-1).tolist())}, decode=True)
    dev = fi.to("cuda")
    eager = runner.forward_logits(fi)
    graph = graphs.replay(dev).float()  # 5 rows, replayed padded to 8
    torch.testing.assert_close(graph, eager, atol=2e-2, rtol=2e-2)

    triton_backend = runner.attn_backend
    runner.attn_backend = get_attention_backend_class("torch_ref")(
        runner.kv_pool, runner.req_to_token_pool, num_heads=runner.model_config.num_heads
    )
    try:
        ref = runner.forward_logits(fi)
    finally:
        runner.attn_backend = triton_backend
    rel = float((eager - ref).norm() / ref.norm())
    assert rel < 2e-2, rel


def test_host_batch_replays_like_a_device_batch(runner) -> None:
    """A batch whose per-row tensors are on the host reaches the graph through the pinned staging
    ring: the same logits as the same batch on the device, over more replays than the ring has
    blocks, and a smaller batch after a larger one (its padding rows restaged)."""
    from phloem.runtime.executor.cuda_graph import CudaGraphRunner
    from phloem.runtime.executor.model_runner import DirectBatcher, greedy_sampling_info
    from phloem.runtime.forward_io import ForwardInput

    batcher = DirectBatcher(runner)
    gen = torch.Generator().manual_seed(1)
    seqs = [batcher.new_sequence() for _ in range(5)]
    prompts = {
        s: torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist()
        for s, n in zip(seqs, [9, 60, 4, 33, 17])
    }
    first = batcher.logits(prompts).argmax(-1).tolist()
    graphs = CudaGraphRunner(runner.model, runner.attn_backend, max_bs=8)
    graphs.capture()
    fi = batcher.build({s: [t] for s, t in zip(seqs, first)}, decode=True)

    def head(f: ForwardInput, n: int) -> ForwardInput:
        return ForwardInput(
            mode=f.mode, input_ids=f.input_ids[:n], positions=f.positions[:n], out_slots=f.out_slots[:n],
            req_pool_indices=f.req_pool_indices[:n], seq_lens=f.seq_lens[:n], prefix_lens=f.prefix_lens[:n],
            extend_lens=f.extend_lens[:n], sampling=greedy_sampling_info(n),
        )  # fmt: skip

    for n in (5, 3, 5, 1):
        small = head(fi, n)
        want = graphs.replay(small.to("cuda")).clone()
        for _ in range(6):  # the ring has 4 blocks
            got = graphs.replay(small)
            assert torch.equal(got, want), f"batch of {n}: host-staged replay differs"
