"""The decode kernel's split rule (``decode_num_splits``): a pure function of shapes."""

from __future__ import annotations

import pytest

triton_kernels = pytest.importorskip("phloem.runtime.attention.triton_kernels")
decode_num_splits = triton_kernels.decode_num_splits


@pytest.mark.parametrize("batch", [1, 2, 8, 16, 32, 64, 96, 128, 168, 256, 1024])
@pytest.mark.parametrize("kv_heads", [1, 2, 8, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_splits_stay_in_range(batch: int, kv_heads: int, head_dim: int) -> None:
    splits = decode_num_splits(batch, kv_heads, head_dim)
    assert 1 <= splits <= 16
    if head_dim >= 128:  # mixed context lengths need several programs per request
        assert splits >= (2 if batch * kv_heads >= 1024 else 3)


def test_wide_heads_follow_the_sweep() -> None:
    """Qwen3 / Llama heads (8 KV heads of 128): the settings the H200 split sweeps favoured,
    three splits up to 1,023 (request, KV head) pairs and two from 1,024."""
    assert [decode_num_splits(b, 8, 128) for b in (1, 16, 32, 64, 96, 127, 128, 208, 256)] == [
        16, 8, 4, 3, 3, 3, 2, 2, 2,
    ]  # fmt: skip


def test_narrow_heads_keep_two_waves() -> None:
    """SmolLM2 heads (3 KV heads of 64): about two waves of 132 programs, one split once full."""
    assert [decode_num_splits(b, 3, 64) for b in (1, 16, 44, 64, 88, 256)] == [16, 6, 2, 2, 1, 1]


def test_splits_never_grow_with_batch() -> None:
    for kv_heads, head_dim in ((8, 128), (3, 64), (2, 128)):
        seq = [decode_num_splits(b, kv_heads, head_dim) for b in range(1, 300)]
        assert all(a >= b for a, b in zip(seq, seq[1:]))
