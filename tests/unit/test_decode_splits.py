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


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` records the launch's settings."""

    def __init__(self) -> None:
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append({"grid": grid, **kw})


@pytest.mark.parametrize(
    ("batch", "dtype", "want"),
    [
        (64, "bfloat16", (128, 4, 2)),  # 512 (request, KV head) pairs: the wide tile
        (208, "float16", (128, 4, 2)),
        (63, "bfloat16", (64, 2, 3)),  # fewer pairs keep the older setting
        (64, "float32", (32, 8, 2)),
        (64, "fp8", (128, 4, 3)),
    ],
)
def test_decode_launch_settings(monkeypatch, batch: int, dtype: str, want: tuple[int, int, int]) -> None:
    import torch

    split, merge = _Recorder(), _Recorder()
    monkeypatch.setattr(triton_kernels, "_decode_split_kernel", split)
    monkeypatch.setattr(triton_kernels, "_decode_merge_kernel", merge)
    q_dtype = torch.bfloat16 if dtype == "fp8" else getattr(torch, dtype)
    kv_dtype = torch.float8_e4m3fn if dtype == "fp8" else q_dtype
    q = torch.zeros(batch, 32, 128, dtype=q_dtype)
    kv = torch.zeros(16, 8, 128, dtype=kv_dtype)
    part_o, part_lse = triton_kernels.decode_scratch(batch, 32, 8, 128, "cpu")
    ints = torch.zeros(batch, dtype=torch.int64)
    triton_kernels.decode_attention(
        q, kv, kv, torch.empty_like(q), part_o, part_lse, req_to_token=torch.zeros(batch, 16, dtype=torch.int32),
        req_pool_indices=ints, seq_lens=ints, sm_scale=1.0,
    )  # fmt: skip
    got = split.launches[0]
    assert (got["BLOCK_N"], got["num_warps"], got["num_stages"]) == want
    assert got["NUM_SPLITS"] == part_lse.shape[2] == merge.launches[0]["NUM_SPLITS"]
