"""torch_ref paged attention vs a naive dense causal attention on random inputs."""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.attention.registry import get_attention_backend_class, resolve_attention_backend
from phloem.runtime.cache.kv_pool import KVPool, ReqToTokenPool
from phloem.runtime.executor.model_runner import greedy_sampling_info
from phloem.runtime.forward_io import ForwardInput, ForwardMode

HQ, HK, D, SLOTS = 6, 2, 16, 512


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """q [e, Hq, D] over k, v [prefix + e, Hk, D]; query i sits at position prefix + i."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [S, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5  # [Hq, e, S]
    q_pos = torch.arange(prefix, prefix + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_batch(prefix_lens: list[int], extend_lens: list[int], mode: ForwardMode, seed: int):
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(1, SLOTS, HK, D, torch.float32, "cpu")
    rtt = ReqToTokenPool(8, 128, "cpu")
    perm = torch.randperm(SLOTS - 1, generator=gen) + 1  # scattered slots, never the padding slot
    rows, full_k, full_v, used = [], [], [], 0
    for p, e in zip(prefix_lens, extend_lens):
        row = rtt.alloc()
        slots = perm[used : used + p + e]
        used += p + e
        rtt.req_to_token[row, : p + e] = slots
        k, v = torch.randn(p + e, HK, D, generator=gen), torch.randn(p + e, HK, D, generator=gen)
        pool.set_kv(0, slots[:p], k[:p], v[:p])  # the cached prefix
        rows.append(row)
        full_k.append(k)
        full_v.append(v)
    ext = torch.tensor(extend_lens)
    out_slots = torch.cat([rtt.req_to_token[r, p : p + e] for r, p, e in zip(rows, prefix_lens, extend_lens)])
    fi = ForwardInput(
        mode=mode,
        input_ids=torch.zeros(int(ext.sum()), dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)]),
        out_slots=out_slots,
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(prefix_lens) + ext,
        prefix_lens=torch.tensor(prefix_lens),
        extend_lens=ext,
        sampling=greedy_sampling_info(len(rows)),
    )
    q = torch.randn(int(ext.sum()), HQ, D, generator=gen)
    new_k = torch.cat([k[p:] for k, p in zip(full_k, prefix_lens)])
    new_v = torch.cat([v[p:] for v, p in zip(full_v, prefix_lens)])
    return pool, rtt, fi, q, new_k, new_v, full_k, full_v


CASES = {
    "extend_no_prefix": ([0], [7], ForwardMode.EXTEND),
    "extend_with_prefix": ([5], [3], ForwardMode.EXTEND),
    "extend_mixed": ([0, 9, 3, 20], [4, 1, 6, 2], ForwardMode.EXTEND),
    "decode": ([3, 17, 1, 40], [1, 1, 1, 1], ForwardMode.DECODE),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_ref_matches_naive(case: str, seed: int) -> None:
    prefix_lens, extend_lens, mode = CASES[case]
    pool, rtt, fi, q, k, v, full_k, full_v = make_batch(prefix_lens, extend_lens, mode, seed)
    backend = get_attention_backend_class("torch_ref")(pool, rtt, num_heads=HQ)
    backend.init_metadata(fi)
    out = backend.forward(q, k, v, 0)
    start = 0
    for p, e, fk, fv in zip(prefix_lens, extend_lens, full_k, full_v):
        expect = naive_attention(q[start : start + e], fk, fv, p)
        torch.testing.assert_close(out[start : start + e], expect, atol=1e-5, rtol=1e-5)
        start += e
    # new K/V landed in the pool at out_slots
    torch.testing.assert_close(pool.k_buffer[0][fi.out_slots], k)
    torch.testing.assert_close(pool.v_buffer[0][fi.out_slots], v)


def test_decode_equals_extend_of_one_token() -> None:
    prefix_lens, extend_lens = [4, 11], [1, 1]
    a = make_batch(prefix_lens, extend_lens, ForwardMode.DECODE, 3)
    b = make_batch(prefix_lens, extend_lens, ForwardMode.EXTEND, 3)
    outs = []
    for pool, rtt, fi, q, k, v, *_ in (a, b):
        backend = get_attention_backend_class("torch_ref")(pool, rtt, num_heads=HQ)
        backend.init_metadata(fi)
        outs.append(backend.forward(q, k, v, 0))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)


def test_registry_auto_on_cpu() -> None:
    assert resolve_attention_backend("auto", "cpu") == "cpu"
    with pytest.raises(ValueError):
        resolve_attention_backend("nope", "cpu")


def test_kv_pool_and_req_to_token_pool() -> None:
    pool = KVPool(30, 10, 3, 64, torch.bfloat16, "cpu")
    assert pool.bytes_per_token == 3 * 64 * 2 * 30 * 2 == 23040
    assert pool.size == 9 and pool.k_buffer[0].shape == (10, 3, 64)
    rtt = ReqToTokenPool(2, 16, "cpu")
    a, b = rtt.alloc(), rtt.alloc()
    assert {a, b} == {0, 1} and rtt.alloc() is None and rtt.available_size == 0
    rtt.free(a)
    assert rtt.available_size == 1 and rtt.alloc() == a
    with pytest.raises(ValueError):
        rtt.free(5)
