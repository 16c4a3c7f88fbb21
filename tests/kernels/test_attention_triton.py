"""Triton paged attention against the ``torch_ref`` oracle on fresh random batches (CUDA).

The same kernels run on the CPU under Triton's interpreter in ``test_attention_triton_interpret.py``.
"""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.attention import triton_extend_contig
from phloem.runtime.forward_io import ForwardMode

from .attention_cases import (
    BATCHES,
    DTYPES,
    HEADS,
    check_contiguous_extend_on_views,
    check_decode_new_kv,
    compare_with_ref,
    make_batch,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA (CPU coverage: the interpreter test)"
    ),
]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_triton_matches_torch_ref(batch: str, heads: str, dtype: str, monkeypatch) -> None:
    """Every pass through the pool kernels (extend included: the contiguous-K/V extend kernel has
    its own test below)."""
    monkeypatch.setattr(triton_extend_contig, "MODE", "pool")
    prefix_lens, extend_lens, mode = BATCHES[batch]
    h = HEADS[heads]
    for seed in (0, 1):
        b = make_batch(prefix_lens, extend_lens, mode, h, dtype=DTYPES[dtype], device="cuda", seed=seed)
        compare_with_ref("triton", b, h.q, extend_kernel="pool")


EXTEND_BATCHES = sorted(name for name, (_, _, mode) in BATCHES.items() if mode == ForwardMode.EXTEND)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("batch", EXTEND_BATCHES)
def test_contiguous_extend_matches_torch_ref(batch: str, heads: str, dtype: str, monkeypatch) -> None:
    """The extend kernel that reads the new keys from k, v (compute capability 9.0 and later)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need compute capability 9.0")
    monkeypatch.setattr(triton_extend_contig, "MODE", "contiguous")
    prefix_lens, extend_lens, mode = BATCHES[batch]
    h = HEADS[heads]
    for seed in (0, 1):
        b = make_batch(prefix_lens, extend_lens, mode, h, dtype=DTYPES[dtype], device="cuda", seed=seed)
        compare_with_ref("triton", b, h.q, extend_kernel="contiguous")
    for tiles in (None, (64, 64), (16, 64)):  # prefix keys, new keys a tile
        check_contiguous_extend_on_views(h, device="cuda", seed=5, tiles=tiles)


@pytest.mark.parametrize("batch_size", [1, 3, 64, 200])
def test_decode_split_count_does_not_change_result(batch_size: int) -> None:
    """Decode splits the keys by batch size; a request's result must not depend on its batch."""
    h = HEADS["gqa4_d128"]
    lens = [(97 * i) % 1500 + (2500 if i % 7 == 0 else 0) for i in range(batch_size)]  # ragged
    b = make_batch(
        lens,
        [1] * batch_size,
        BATCHES["decode_long"][2],
        h,
        dtype=torch.float32,
        device="cuda",
        seed=batch_size,
    )
    compare_with_ref("triton", b, h.q)


# decode contexts (before the new token): alone, last and first in 64- and 128-key blocks, long
NEW_KV_LENS = [0, 63, 64, 127, 128, 17, 300, 1000, 2047]


@pytest.mark.parametrize("via_backend", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_decode_rotates_and_stores_the_new_token(
    heads: str, dtype: str, qk_norm: bool, via_backend: bool
) -> None:
    """The decode kernel rotating q and the new k and writing the new K/V itself (``NewTokenKV``)
    matches ``rope_store_`` and the plain decode kernel (9 requests: 16 key splits)."""
    check_decode_new_kv(
        NEW_KV_LENS, HEADS[heads], dtype=DTYPES[dtype], device="cuda", seed=1, qk_norm=qk_norm,
        via_backend=via_backend,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_decode_stores_the_new_token_in_a_wide_batch(dtype: str) -> None:
    """The same at 128 requests of Llama-3-8B heads (2 key splits, the wide tile in bf16)."""
    lens = [(53 * i) % 700 for i in range(128)]
    check_decode_new_kv(
        lens, HEADS["gqa4_d128"], dtype=DTYPES[dtype], device="cuda", seed=2, via_backend=True
    )
