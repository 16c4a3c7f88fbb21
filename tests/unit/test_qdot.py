"""Integer-dot layers on GGUF blocks: every kernel variant bit for bit against the torch reference."""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.layers import qdot
from phloem.runtime.layers.qdot import Q4DotWeight, Q8DotWeight
from phloem.runtime.layers.quant import Q4Weight, Q8Weight

# (N, K) of the default model's projections (qkv, o, gate_up, down) and odd row counts
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (37, 64), (203, 576), (1, 32)]
BATCHES = [1, 3, 6, 17]


def _q4(n: int, k: int, seed: int) -> Q4Weight:
    """Random Q4_1 blocks with float16 scales and minimums (as a GGUF holds them)."""
    gen = torch.Generator().manual_seed(seed)
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.15).half().float()
    return Q4Weight(qs, d, m)


def _q8(n: int, k: int, seed: int) -> Q8Weight:
    return qdot.q8_blocks_from_float(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, :32] = 0  # an all-zero block: scale 0
    return x


@pytest.fixture(scope="module", params=qdot.ISAS)
def kernels(request: pytest.FixtureRequest) -> object:
    if request.param not in qdot.supported_isas():
        pytest.skip(f"this CPU has no {request.param}")
    built = qdot.build_kernels(request.param)
    assert built is not None, f"the {request.param} kernel must build where the CPU supports it"
    return built


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", BATCHES)
def test_q4_kernel_matches_reference_bit_for_bit(kernels: object, n: int, k: int, m: int) -> None:
    w = Q4DotWeight.from_blocks(_q4(n, k, n + k))
    x = _x(m, k, m)
    got = kernels.q4_dot(x, w.packed, n)  # type: ignore[attr-defined]
    assert torch.equal(got, w.reference(x))


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", BATCHES)
def test_q8_kernel_matches_reference_bit_for_bit(kernels: object, n: int, k: int, m: int) -> None:
    w = Q8DotWeight.from_blocks(_q8(n, k, n + k))
    x = _x(m, k, m)
    got = kernels.q8_dot(x, w.packed, n)  # type: ignore[attr-defined]
    assert torch.equal(got, w.reference(x))


def test_lm_head_shape(kernels: object) -> None:
    """The default model's LM head: 49,152 rows of the Q8_0 embedding."""
    w = Q8DotWeight.from_blocks(_q8(49152, 576, 5))
    x = _x(2, 576, 6)
    assert torch.equal(kernels.q8_dot(x, w.packed, 49152), w.reference(x))  # type: ignore[attr-defined]


def test_activation_quantization_matches_reference(kernels: object) -> None:
    x = _x(5, 1536, 7)
    xq, dx, sx = kernels.quantize_activations(x)  # type: ignore[attr-defined]
    q, d, s = qdot.quantize_activations_ref(x)
    assert torch.equal(xq.float().reshape(q.shape), q)
    assert torch.equal(dx, d) and torch.equal(sx, s)


def test_rows_are_batch_invariant(kernels: object) -> None:
    w = Q4DotWeight.from_blocks(_q4(200, 576, 1))
    x = _x(17, 576, 2)
    full = kernels.q4_dot(x, w.packed, 200)  # type: ignore[attr-defined]
    for r in (0, 5, 16):
        assert torch.equal(kernels.q4_dot(x[r : r + 1], w.packed, 200), full[r : r + 1])  # type: ignore[attr-defined]


def test_packing_round_trips_the_blocks() -> None:
    b4 = _q4(37, 96, 3)
    w4 = Q4DotWeight.from_blocks(b4)
    assert w4.packed.shape == (5, 3, qdot.Q4_RECORD)  # 37 rows -> 5 tiles of 8; 96 / 32 blocks
    assert torch.equal(w4.dequantize(), b4.dequantize())
    b8 = _q8(37, 96, 4)
    w8 = Q8DotWeight.from_blocks(b8)
    assert w8.packed.shape == (5, 3, qdot.Q8_RECORD)
    assert torch.equal(w8.dequantize(), b8.dequantize())


def test_scales_must_be_float16_values() -> None:
    w = Q8Weight(torch.ones(8, 32, dtype=torch.int8), torch.full((8, 1), 0.1))  # 0.1 is no float16
    with pytest.raises(ValueError, match="float16"):
        Q8DotWeight.from_blocks(w)


def test_reference_is_close_to_float_math() -> None:
    """The int8 activations cost a little accuracy, not more: within 1% of the float32 product's
    scale on random data (the exactness tests above pin the arithmetic itself)."""
    w = Q4DotWeight.from_blocks(_q4(576, 576, 8))
    x = _x(3, 576, 9)
    exact = x @ w.dequantize().T
    err = (w.reference(x) - exact).abs().max() / exact.abs().max()
    assert err < 0.01


def test_layer_falls_back_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    w = Q4DotWeight.from_blocks(_q4(40, 64, 10))
    x = _x(3, 64, 11)
    monkeypatch.setattr(qdot, "_chosen", [None])  # as where no kernel builds
    assert torch.equal(w.matmul(x), w.reference(x))


def test_default_isa_is_the_fastest_supported() -> None:
    isas = qdot.supported_isas()
    if not isas:
        pytest.skip("no AVX2")
    assert qdot.kernels_isa() == isas[0]
