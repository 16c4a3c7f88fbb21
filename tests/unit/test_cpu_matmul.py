"""Weight-major few-row projections on the CPU (runtime/layers/cpu_matmul.py): routing, and
equality with ``F.linear`` (the oracle) up to float32 rounding, through the layers that use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from phloem.runtime.layers import cpu_matmul
from phloem.runtime.layers.cpu_matmul import (
    WEIGHT_MAJOR_MAX_ELEMENTS,
    WEIGHT_MAJOR_MAX_ROWS,
    WEIGHT_MAJOR_MIN_ROWS,
    use_weight_major,
    weight_major_linear,
)
from phloem.runtime.layers.embedding import LMHead
from phloem.runtime.layers.linear import Linear


@pytest.fixture(autouse=True)
def _switch_on():
    cpu_matmul.set_weight_major(True)
    yield
    cpu_matmul.set_weight_major(True)


@pytest.mark.parametrize("shape", [(2, 48), (5, 48), (3, 4, 48), (64, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_f_linear(shape, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen)
    w = torch.randn(80, 48, generator=gen)
    b = torch.randn(80, generator=gen) if bias else None
    y = weight_major_linear(x, w, b)
    assert y.shape == (*shape[:-1], 80) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_routing_by_device_dtype_rows_size_and_switch():
    w = torch.randn(80, 48)
    assert not use_weight_major(torch.randn(1, 48), w)  # one row: already a matrix-vector product
    assert not use_weight_major(torch.randn(WEIGHT_MAJOR_MIN_ROWS - 1, 48), w)  # F.linear won there
    assert use_weight_major(torch.randn(WEIGHT_MAJOR_MIN_ROWS, 48), w)
    assert use_weight_major(torch.randn(2, 8, 48), w)  # rows counted over the leading axes
    assert use_weight_major(torch.randn(WEIGHT_MAJOR_MAX_ROWS, 48), w)
    assert not use_weight_major(torch.randn(WEIGHT_MAJOR_MAX_ROWS + 1, 48), w)  # the blocked GEMM wins
    big = torch.empty(WEIGHT_MAJOR_MAX_ELEMENTS // 16 + 1, 16)  # an LM head's size: F.linear
    assert not use_weight_major(torch.randn(16, 16), big)
    assert not use_weight_major(torch.randn(16, 48, dtype=torch.bfloat16), w.bfloat16())
    assert not use_weight_major(torch.randn(16, 48), torch.randn(48, 80).t())  # strided weight
    cpu_matmul.set_weight_major(False)
    assert not use_weight_major(torch.randn(16, 48), w)


def test_linear_and_lm_head_take_the_route_and_match_the_oracle(monkeypatch):
    from phloem.runtime.layers import embedding, linear

    calls = []

    def counted(*args):
        calls.append(args[1].shape)
        return weight_major_linear(*args)

    monkeypatch.setattr(linear, "weight_major_linear", counted)
    monkeypatch.setattr(embedding, "weight_major_linear", counted)
    gen = torch.Generator().manual_seed(1)
    lin = Linear(48, 80, bias=True)
    head = LMHead(100, 48)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 48, generator=gen))
        lin.bias.copy_(torch.randn(80, generator=gen))
        head.weight.copy_(torch.randn(100, 48, generator=gen))
    x = torch.randn(WEIGHT_MAJOR_MIN_ROWS + 2, 48, generator=gen)
    on_lin, on_head = lin(x), head(x)
    assert calls == [(80, 48), (100, 48)]
    cpu_matmul.set_weight_major(False)
    torch.testing.assert_close(on_lin, lin(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(on_head, head(x), rtol=1e-5, atol=1e-5)
    assert on_head.dtype == torch.float32 and len(calls) == 2
