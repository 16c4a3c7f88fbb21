"""The spans a decode attention prefetches into L2 (``runtime/layers/l2_prefetch.py``): whole
weights in pieces while they fit the budget, then the leading columns of every row of the first
that does not, nothing after it."""

from __future__ import annotations

import pytest
import torch

from phloem.runtime.layers.l2_prefetch import BUDGET_ENV, budget_bytes, lanes, plan_spans, prefetch_table


def _covered(spans: list[tuple[int, int]], w: torch.Tensor) -> torch.Tensor:
    """Which bytes of ``w``'s storage the spans cover, as a ``[rows, row_bytes]`` mask."""
    rows, row_bytes = w.shape[0], w.stride(0) * w.element_size()
    mask = torch.zeros(rows * row_bytes, dtype=torch.bool)
    base = w.data_ptr()
    for addr, size in spans:
        if base <= addr < base + rows * row_bytes:
            mask[addr - base : addr - base + size] = True
    return mask.view(rows, row_bytes)


def test_whole_weights_in_pieces_then_leading_columns() -> None:
    a = torch.zeros(64, 128, dtype=torch.bfloat16)  # 16 KiB
    b = torch.zeros(32, 256, dtype=torch.bfloat16)  # 16 KiB
    c = torch.zeros(100, 512, dtype=torch.bfloat16)  # 100 KiB, 1 KiB a row
    budget = 16384 + 16384 + 100 * 304 + 7  # c: 304 bytes a row fit, 16-byte multiple
    spans = plan_spans([a, b, c], budget, piece=4096)
    assert all(size > 0 and size % 16 == 0 and addr % 16 == 0 for addr, size in spans)
    assert _covered(spans, a).all() and _covered(spans, b).all()
    cov = _covered(spans, c)
    assert cov[:, :304].all() and not cov[:, 304:].any()
    assert len(spans) == 4 + 4 + 100  # a and b in 4 KiB pieces; c a span a row
    assert sum(size for _, size in spans) <= budget


def test_the_weights_after_a_partial_one_are_left_out() -> None:
    a = torch.zeros(256, 256, dtype=torch.bfloat16)  # 128 KiB
    b = torch.zeros(8, 64, dtype=torch.bfloat16)
    spans = plan_spans([a, b], 64 << 10)
    assert _covered(spans, a)[:, :256].all() and not _covered(spans, a)[:, 256:].any()
    assert not _covered(spans, b).any()


def test_strided_rows_get_a_span_each() -> None:
    full = torch.zeros(16, 256, dtype=torch.bfloat16)
    w = full[:, :64]  # rows 512 bytes apart, 128 bytes each
    spans = plan_spans([w], 1 << 20)
    assert spans == [(w.data_ptr() + r * 512, 128) for r in range(16)]


def test_small_budget_and_unfit_weights_give_nothing() -> None:
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert plan_spans([w], 0) == []
    assert plan_spans([w], 15) == []
    assert plan_spans([w], 64 * 8) == []  # 8 bytes a row: under the 16-byte granularity
    odd = torch.zeros(8, 7, dtype=torch.bfloat16)  # 14-byte rows
    assert plan_spans([odd, w], 1 << 20) == []
    assert plan_spans([torch.zeros(4096, dtype=torch.bfloat16)], 1 << 20) == []  # not 2-D
    assert prefetch_table([w], 1 << 20) is None  # a host weight: no table


def test_lanes_hold_a_share_and_a_lane_per_thread() -> None:
    assert lanes(1024, 128, 2) == 64  # 8 spans a program, but 64 threads
    assert lanes(4096, 16, 2) == 256
    assert lanes(1, 4, 4) == 128


def test_budget_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BUDGET_ENV, "0.5")
    assert budget_bytes() == 1 << 19
    monkeypatch.setenv(BUDGET_ENV, "0")
    assert budget_bytes() == 0
    monkeypatch.setenv(BUDGET_ENV, "lots")
    with pytest.raises(ValueError, match=BUDGET_ENV):
        budget_bytes()


def test_weights_after_attention_in_the_order_a_layer_reads_them() -> None:
    from phloem.runtime.layers.quant import quantize_model
    from phloem.runtime.models.config import ModelConfig
    from phloem.runtime.models.llama import LlamaForCausalLM, weights_after_attention

    cfg = ModelConfig(
        arch="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3,
        num_heads=4, num_kv_heads=2, head_dim=16, context_len=256,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    got = weights_after_attention(model)
    assert sorted(got) == [0, 1, 2]
    for i, layer in enumerate(model.model.layers):
        want = [layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
        assert [w.data_ptr() for w in got[i]] == [w.data_ptr() for w in want]
    quantize_model(model, "int8")  # no float weights left: nothing to prefetch
    assert all(ws == [] for ws in weights_after_attention(model).values())
