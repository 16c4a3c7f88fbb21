"""The CPU backend's one-call decode against the torch reference it replaces."""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.attention.base import QKNorm
from phloem.runtime.attention.cpu import CpuBackend
from phloem.runtime.attention.torch_ref import TorchRefBackend
from phloem.runtime.forward_io import ForwardMode
from phloem.runtime.layers.cpu_ops import cpu_kernels
from phloem.runtime.layers.rotary import RotaryEmbedding

from tests.unit.test_attention_torch_ref import HQ, make_batch

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no AVX2 or no compiler")

DECODES = {"one": [40], "four": [3, 17, 1, 40], "long": [120, 2]}


def _run(backend_cls: type, prefix_lens: list[int], seed: int, qk_norm: QKNorm | None = None):
    pool, rtt, fi, q, k, v, *_ = make_batch(prefix_lens, [1] * len(prefix_lens), ForwardMode.DECODE, seed)
    rotary = RotaryEmbedding(q.shape[-1], 256, 10000.0)
    backend = backend_cls(pool, rtt, num_heads=HQ)
    backend.init_metadata(fi)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # views into one row, as the model's
    q, k, v = (
        t.view(t.shape[0], -1, q.shape[-1]) for t in qkv.split([q[0].numel(), k[0].numel(), v[0].numel()], 1)
    )
    out = backend.forward(q, k, v, 0, cos_sin=rotary.cos_sin(fi.positions), qk_norm=qk_norm)
    return out, pool, fi


@pytest.mark.parametrize("case", sorted(DECODES))
def test_decode_matches_the_reference(case: str) -> None:
    got, pool, fi = _run(CpuBackend, DECODES[case], 0)
    expect, ref_pool, _ = _run(TorchRefBackend, DECODES[case], 0)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    # RoPE and the pool write are the reference's bit for bit
    assert torch.equal(pool.k_buffer[0], ref_pool.k_buffer[0])
    assert torch.equal(pool.v_buffer[0], ref_pool.v_buffer[0])


def test_qk_norm_layers_take_the_reference_path() -> None:
    from tests.unit.test_attention_torch_ref import D

    norm = QKNorm(torch.rand(D) + 0.5, torch.rand(D) + 0.5, 1e-6)
    got, *_ = _run(CpuBackend, [5, 9], 1, qk_norm=norm)
    expect, *_ = _run(TorchRefBackend, [5, 9], 1, qk_norm=norm)
    assert torch.equal(got, expect)


def _verify(cpu_rows: bool, qk_norm: QKNorm | None):
    """A verify pass of two chains (3 and 2 nodes after cached prefixes of 5 and 9) through
    :class:`CpuTreeVerifyAttention` or the reference :class:`TreeVerifyAttention`."""
    from phloem.runtime.speculative.tree import DraftTree
    from phloem.runtime.speculative.verify import CpuTreeVerifyAttention, TreeVerifyAttention, VerifyRequest

    prefix, extend = [5, 9], [3, 2]
    pool, rtt, fi, q, k, v, *_ = make_batch(prefix, extend, ForwardMode.EXTEND, 3)
    slots = fi.out_slots.split(extend)
    reqs = [
        VerifyRequest(int(row), p, DraftTree.chain(0, [0] * (e - 1)), s)
        for row, p, e, s in zip(fi.req_pool_indices.tolist(), prefix, extend, slots)
    ]
    backend = (CpuTreeVerifyAttention if cpu_rows else TreeVerifyAttention)(pool, rtt, num_heads=HQ)
    backend.plan(reqs)
    rotary = RotaryEmbedding(q.shape[-1], 256, 10000.0)
    out = backend.forward(q, k, v, 0, cos_sin=rotary.cos_sin(fi.positions), qk_norm=qk_norm)
    return out, pool, backend


def test_verify_rows_match_the_reference_verify() -> None:
    got, pool, backend = _verify(True, None)
    expect, ref_pool, _ = _verify(False, None)
    assert backend.decode_tables() is not None  # the kernel ran (the whole step may take the pass)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool.k_buffer[0], ref_pool.k_buffer[0])
    assert torch.equal(pool.v_buffer[0], ref_pool.v_buffer[0])


def test_a_verify_layer_the_kernel_does_not_cover_takes_the_reference_plan() -> None:
    from tests.unit.test_attention_torch_ref import D

    norm = QKNorm(torch.rand(D) + 0.5, torch.rand(D) + 0.5, 1e-6)
    got, _, backend = _verify(True, norm)
    expect, *_ = _verify(False, norm)
    assert backend.decode_tables() is None  # left the rows for the rest of the pass
    assert torch.equal(got, expect)
