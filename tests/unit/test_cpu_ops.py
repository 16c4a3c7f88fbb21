"""The CPU RMSNorm kernel against the torch reference, through the layer the model calls."""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.layers.cpu_ops import cpu_kernels
from phloem.runtime.layers.rmsnorm import RMSNorm, add_rms_norm_ref, rms_norm_ref

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no AVX2 or no compiler")


def _norm(h: int, seed: int) -> RMSNorm:
    layer = RMSNorm(h, 1e-5)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(h, generator=torch.Generator().manual_seed(seed)) + 0.5)
    return layer


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("h", [576, 100])
def test_norm_and_residual_add_match_the_reference(rows: int, h: int) -> None:
    gen = torch.Generator().manual_seed(rows + h)
    x, residual = torch.randn(rows, h, generator=gen), torch.randn(rows, h, generator=gen) * 4
    layer = _norm(h, rows)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), rms_norm_ref(x, layer.weight, layer.eps), atol=1e-6, rtol=1e-5)
        out, total = layer(x, residual)
        ref_out, ref_total = add_rms_norm_ref(x, residual, layer.weight, layer.eps)
    assert torch.equal(total, ref_total)  # the running sum is the same float add
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)


def test_strided_rows_and_batch_invariance() -> None:
    wide = torch.randn(5, 1000)
    x = wide[:, 100:676]  # rows of a wider tensor, as a split of a fused projection gives
    layer = _norm(576, 0)
    with torch.inference_mode():
        full = layer(x)
        torch.testing.assert_close(full, rms_norm_ref(x, layer.weight, layer.eps), atol=1e-6, rtol=1e-5)
        for r in range(5):
            assert torch.equal(layer(x[r : r + 1]), full[r : r + 1])


def test_training_keeps_the_differentiable_reference() -> None:
    layer = _norm(64, 1)
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None
