"""The whole-step CPU decode (``models/cpu_decode.py``, ``layers/decode_step.h``) against the
layer-by-layer module path, and the SiLU x mul kernel it uses against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.layers.cpu_ops import cpu_kernels
from phloem.runtime.layers.qdot import kernels_isa
from phloem.runtime.model_files import resolve_model
from phloem.runtime.models import cpu_decode

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(cpu_kernels() is None or kernels_isa() is None, reason="no AVX2 or no compiler"),
]


@pytest.fixture(scope="module")
def batcher() -> DirectBatcher:
    runner = ModelRunner(resolve_model(None), dtype="float32", device="cpu", max_total_tokens=2048,
                         max_running_requests=4, quantization="gguf", attention_backend="cpu")  # fmt: skip
    return DirectBatcher(runner)


def _decode(b: DirectBatcher, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Logits of a prefill and ``steps`` greedy decode steps of ``prompts`` in one batch."""
    seqs = [b.new_sequence() for _ in prompts]
    try:
        out = [b.logits(dict(zip(seqs, prompts)))]
        for _ in range(steps):
            nxt = out[-1].argmax(-1).tolist()
            out.append(b.logits({s: [t] for s, t in zip(seqs, nxt)}, decode=True))
        return out
    finally:
        for s in seqs:
            b.release(s)


def test_one_call_step_is_the_module_path_bit_for_bit(batcher: DirectBatcher, monkeypatch) -> None:
    calls = []
    real = cpu_decode.run_decode_step

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], list(range(100, 137)), [42]]  # lengths 11, 37, 1
    monkeypatch.setattr(cpu_decode, "run_decode_step", counted)
    with torch.no_grad():
        fast = _decode(batcher, prompts, 12)
    assert calls.count(True) == 12  # every decode step took the one call, no prefill did
    monkeypatch.setattr(cpu_decode, "run_decode_step", lambda *args: None)
    with torch.no_grad():
        slow = _decode(batcher, prompts, 12)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def test_not_covered_models_keep_the_module_path(batcher: DirectBatcher) -> None:
    model = batcher.runner.model.model
    cpu_decode.forget(model)
    assert cpu_decode._step_for(model, batcher.runner.attn_backend) is not None
    cpu_decode.forget(model)
    layer = model.layers[3].mlp.down_proj
    quant = layer.quant
    layer.quant = None  # a projection the step does not cover (a float weight)
    try:
        assert cpu_decode._step_for(model, batcher.runner.attn_backend) is None
    finally:
        layer.quant = quant
        cpu_decode.forget(model)


def test_silu_and_mul_kernel_matches_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(5, 2 * 1536, generator=gen) * 6
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0, 200.0, -200.0])
    got = cpu_kernels().silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-6, rtol=2e-6)
    assert torch.isfinite(got).all()


def test_a_tree_verify_computes_each_path_node_as_plain_decoding(batcher: DirectBatcher) -> None:
    """A verify pass over a tree (root -> a -> c, root -> d) gives each node on a path the logits
    plain decoding gives that token, bit for bit (``CpuTreeVerifyAttention``: each node a decode
    row over its prefix, ancestors and itself)."""
    from phloem.runtime.speculative.tree import DraftTree
    from phloem.runtime.speculative.verify import CpuTreeVerifyAttention, TreeVerifier, VerifyRequest

    prompt, (root, a, c, d) = list(range(200, 223)), (42, 11, 12, 13)
    with torch.no_grad():
        seq = batcher.new_sequence()
        try:
            batcher.logits({seq: prompt})
            plain = [batcher.logits({seq: [t]}, decode=True)[0] for t in (root, a, c)]
        finally:
            batcher.release(seq)
        verifier = TreeVerifier(batcher.runner)
        assert isinstance(verifier.attn, CpuTreeVerifyAttention)
        seq = batcher.new_sequence()
        try:
            batcher.logits({seq: prompt})
            tree = DraftTree([root, a, d, c], [-1, 0, 0, 1])
            slots = torch.arange(batcher._next_slot, batcher._next_slot + len(tree))
            batcher._next_slot += len(tree)
            logits, _, _ = verifier._forward([VerifyRequest(seq, len(prompt), tree, slots)])
        finally:
            batcher.release(seq)
    assert torch.equal(logits[0], plain[0])  # root
    assert torch.equal(logits[1], plain[1])  # a after root
    assert torch.equal(logits[3], plain[2])  # c after root, a (node 2, d, is a sibling of a)
