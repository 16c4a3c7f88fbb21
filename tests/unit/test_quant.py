"""Weight-only quantized layers: the AVX2 kernels against the dequantize-then-matmul reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.layers import quant
from phloem.runtime.layers.linear import Linear
from phloem.runtime.layers.quant import Q4Weight, Q8Weight
from phloem.runtime.model_files import ModelSource, resolve_model

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def _q4_blocks(n: int, k: int, seed: int) -> Q4Weight:
    """Random Q4_1-like blocks with float16-representable scales and minimums."""
    gen = torch.Generator().manual_seed(seed)
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.15).half().float()
    return Q4Weight(qs, d, m)


QWEIGHTS = {
    "q4": lambda n, k: _q4_blocks(n, k, 0),
    "q8": lambda n, k: Q8Weight.from_float(torch.randn(n, k, generator=torch.Generator().manual_seed(1))),
}


@pytest.mark.parametrize("kind", sorted(QWEIGHTS))
@pytest.mark.parametrize("n,k", [(48, 64), (200, 576), (33, 1536)])
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_kernel_matches_reference(kind: str, n: int, k: int, m: int) -> None:
    w = QWEIGHTS[kind](n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    expect = F.linear(x, w.dequantize())
    got = w.matmul(x)
    torch.testing.assert_close(got, expect, atol=1e-5 * k**0.5, rtol=1e-5)
    # batch invariance: every row alone is bit-identical to that row in the batch
    for r in {0, m // 2, m - 1}:
        assert torch.equal(w.matmul(x[r : r + 1]), got[r : r + 1])


def test_many_rows_take_the_dense_path_unless_batch_invariant() -> None:
    w = _q4_blocks(40, 64, 3)
    x = torch.randn(quant.DENSE_MIN_ROWS + 5, 64)
    torch.testing.assert_close(w.matmul(x), F.linear(x, w.dequantize()), atol=1e-4, rtol=0)
    w.dense_min_rows = 0  # what set_batch_invariant does
    assert torch.equal(w.matmul(x)[3:4], w.matmul(x[3:4]))


def test_kernels_are_built_here() -> None:
    """The reference machine has AVX2 and a compiler: the fast path must be the one measured."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2")
    assert quant.kernels_available()


def test_q4_from_float_round_trip() -> None:
    w = torch.randn(16, 64)
    q = Q4Weight.from_float(w)
    step = (w.reshape(16, 2, 32).amax(-1) - w.reshape(16, 2, 32).amin(-1)) / 15
    err = (q.dequantize() - w).abs().reshape(16, 2, 32).amax(-1)
    assert bool((err <= step * 0.5 + 5e-3).all())  # half a step, plus float16 scale/min rounding


def test_q8_round_trip_is_exact_for_q8_0_values() -> None:
    """Q8_0-dequantized values (float16 scale x int8) requantize to the same blocks."""
    d = (torch.rand(10, 4) * 0.01 + 1e-4).half().float()
    q = torch.randint(-127, 128, (10, 128), dtype=torch.int8)
    q[:, ::32] = 127  # each block reaches its maximum, as llama.cpp's quantizer guarantees
    w = Q8Weight(q, d).dequantize()
    again = Q8Weight.from_float(w)
    assert torch.equal(again.qs, q) and torch.equal(again.d, d)


def test_quantized_runner_uses_the_dequantized_weights() -> None:
    """A quantized tiny model equals the float model holding the dequantized weights."""
    kw = {"dtype": "float32", "device": "cpu", "max_total_tokens": 512, "max_running_requests": 4,
          "sampler": lambda logits, info: logits.argmax(-1), "cpu_threads": 1}  # fmt: skip
    for scheme in ("int4", "int8"):
        q = ModelRunner(ModelSource("dummy", "tiny-llama"), quantization=scheme, **kw)
        ref = ModelRunner(ModelSource("dummy", "tiny-llama"), **kw)
        qmods, rmods = dict(q.model.named_modules()), dict(ref.model.named_modules())
        with torch.no_grad():
            for name, mod in qmods.items():
                if isinstance(mod, Linear):
                    rmods[name].weight.copy_(mod.quant.dequantize())
            head = ref.model.lm_head  # its own copy: the embedding lookup keeps the float table
            head.tied_to, head.weight = None, torch.nn.Parameter(q.model.lm_head.quant.dequantize())
        ids = torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(2)).tolist()
        qb, rb = DirectBatcher(q), DirectBatcher(ref)
        sq, sr = qb.new_sequence(), rb.new_sequence()
        torch.testing.assert_close(qb.logits({sq: ids}), rb.logits({sr: ids}), atol=1e-4, rtol=0)
        torch.testing.assert_close(qb.logits({sq: [5]}, decode=True), rb.logits({sr: [5]}, decode=True),
                                   atol=1e-4, rtol=0)  # fmt: skip
        assert q.decode_weight_bytes < ref.decode_weight_bytes / 3


def test_gguf_q4_1_blocks_are_the_dequantized_weights() -> None:
    """The int4 path keeps the default model's Q4_1 blocks: they decode bit-exactly."""
    from phloem.runtime.executor.weights_gguf import load_gguf_q4_blocks, load_gguf_weights

    path = resolve_model(None).path
    cfg, weights = load_gguf_weights(path)
    blocks = load_gguf_q4_blocks(path, cfg)
    assert len(blocks) == 7 * cfg.num_layers
    for name, (qs, d, m) in blocks.items():
        assert torch.equal(Q4Weight(qs, d, m).dequantize(), weights[name]), name
    embed = weights["model.embed_tokens.weight"]
    assert torch.equal(Q8Weight.from_float(embed).dequantize(), embed)  # Q8_0 embedding, exact
