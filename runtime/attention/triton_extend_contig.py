"""Extend attention that reads the new tokens' K/V where the projection left them (Triton, TMA).

The pool kernel (:func:`triton_kernels.extend_attention`) reads every key through the request's
``req_to_token`` row: one slot per key, with pointer loads. But a prefill pass also holds the new
tokens' K and V contiguously, in the qkv projection's output (``rope_store_(..., k_inplace=True)``
leaves the rotated k there), and most keys of a prefill are new: all of them for a prompt with no
cached prefix. This kernel reads the cached prefix through ``req_to_token`` as before, then the
new keys as ``[BLOCK_N, D]`` tiles through tensor descriptors (TMA on Hopper), running the causal
mask on the diagonal tiles only. The same softmax as the pool kernel, in base 2::

    for r, h, i in requests x q_heads x range(e_r):
        keys = pool[req_to_token[r, :s_r]] ++ new_k[start_r : start_r + i + 1]
        out[start_r + i, h] = softmax(q . keys[h // group] * scale) @ values[h // group]

Reading the new tokens' K/V as contiguous rows through tensor-memory-access descriptors, rather
than slot by slot through the pool, is what makes it faster than the pool kernel on a prefill
chunk.

Used for 16-bit K/V pools on compute capability 9.0 and later (and under Triton's interpreter,
where the tests run it) unless ``PHLOEM_EXTEND_KERNEL=pool``; the pool kernel otherwise (fp8
pools read the rounded keys the decode reads, so they keep it).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from phloem.runtime import switches
from phloem.runtime.attention.triton_kernels import EXTEND_BLOCK_M

try:  # Triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pool kernel serves every pass
    TensorDescriptor = None

__all__ = ["MODE", "contiguous_extend_ok", "extend_mode", "extend_attention_contiguous", "extend_tiles"]

# "contiguous" (the default) runs this kernel where it applies; "pool" keeps the pool kernel for
# every pass. ``None`` reads ``PHLOEM_EXTEND_KERNEL`` on each routing decision (a typo raises
# rather than falling back to the pool kernel unnoticed); tests set the attribute.
MODE: str | None = None


def extend_mode() -> str:
    """``contiguous`` or ``pool``: :data:`MODE` where set, else ``PHLOEM_EXTEND_KERNEL``."""
    return MODE or switches.EXTEND_KERNEL.text()
_LOG2E = 1.4426950408889634
BLOCK_N = 32  # keys a tile in both phases by default (see extend_attention_contiguous)
# Prefix-heavy passes take 64-key tiles in both phases (:func:`extend_tiles`), from this many
# query-key pairs over cached prefixes per pair among the new tokens.
WIDE_TILE = 64
WIDE_TILE_MIN_RATIO = 4


def extend_tiles(key_pairs: tuple[int, int] | None) -> tuple[int, int]:
    """``(block_n, block_prefix)`` for a pass with ``key_pairs`` (``ForwardInput.key_pairs``:
    query-key pairs over cached prefixes, pairs among the new tokens).

    64-key tiles in both phases pay off once the cached prefix dominates the pass; without a
    prefix 32 keys a tile are slightly faster. So the wide tiles from a ratio of 4: a radix hit
    on a long shared prompt takes them, and so does a long prompt's k-th chunk from the fourth
    (ratio just under 2(k - 1)); fresh prompts keep 32. (64 for the prefix with 32 for the new
    keys was no better with a prefix and slower without one.)
    """
    if key_pairs is not None and key_pairs[0] >= WIDE_TILE_MIN_RATIO * max(key_pairs[1], 1):
        return WIDE_TILE, WIDE_TILE
    return BLOCK_N, BLOCK_N


@triton.jit
def _online_step(s, v, m_i, l_i, acc):
    """One base-2 online-softmax step: ``s`` [M, N] are scores already times scale * log2(e)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)  # m_i = -inf on the first step: 0, and m_new is finite
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _extend_contig_kernel(
    q_ptr, k_desc, v_desc, k_buf_ptr, v_buf_ptr, out_ptr,
    req_to_token_ptr, req_idx_ptr, prefix_lens_ptr, extend_lens_ptr, q_start_ptr,
    block_req_ptr, block_m_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kbt, stride_kbh, stride_vbt, stride_vbh, stride_rtt, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
):  # fmt: skip
    # grid: (query blocks over the whole batch, q heads); block_req = -1 marks spare blocks
    blk = tl.program_id(0)
    head = tl.program_id(1)
    r = tl.load(block_req_ptr + blk)
    if r < 0:
        return
    m_blk = tl.load(block_m_ptr + blk)
    kv_head = head // GROUP
    prefix = tl.load(prefix_lens_ptr + r)
    ext = tl.load(extend_lens_ptr + r)
    q_start = tl.load(q_start_ptr + r)
    row = tl.load(req_idx_ptr + r)

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)  # offsets among this request's new tokens
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < ext
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # 1. the cached prefix, through req_to_token: every prefix key precedes every new token
    # (its own tile size, BLOCK_P: gathered rows may favour other tiles than descriptor loads)
    for n0 in range(0, prefix, BLOCK_P):
        offs_n = n0 + tl.arange(0, BLOCK_P)
        in_row = offs_n < prefix
        slots = tl.load(req_to_token_ptr + row * stride_rtt + offs_n, mask=in_row, other=0).to(tl.int64)
        k = tl.load(
            k_buf_ptr + slots[:, None] * stride_kbt + kv_head * stride_kbh + offs_d[None, :],
            mask=in_row[:, None],
            other=0.0,
        )
        v = tl.load(
            v_buf_ptr + slots[:, None] * stride_vbt + kv_head * stride_vbh + offs_d[None, :],
            mask=in_row[:, None],
            other=0.0,
        )
        s = tl.where(in_row[None, :], tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m_i, l_i, acc = _online_step(s, v, m_i, l_i, acc)

    # 2. the new tokens, rows q_start.. of the contiguous K/V: whole tiles before the block's
    # first query need no mask (BLOCK_M is a multiple of BLOCK_N)
    col = (kv_head * HEAD_DIM).to(tl.int32)
    diag = m_blk * BLOCK_M
    for n0 in range(0, diag, BLOCK_N):
        k = k_desc.load([(q_start + n0).to(tl.int32), col])
        v = v_desc.load([(q_start + n0).to(tl.int32), col])
        m_i, l_i, acc = _online_step(tl.dot(q, tl.trans(k)) * qk_scale, v, m_i, l_i, acc)
    for n0 in range(diag, tl.minimum(diag + BLOCK_M, ext), BLOCK_N):
        k = k_desc.load([(q_start + n0).to(tl.int32), col])
        v = v_desc.load([(q_start + n0).to(tl.int32), col])
        offs_n = n0 + tl.arange(0, BLOCK_N)
        # a query sees the new keys up to itself; query rows past ext (not stored) see finite
        # values: the next request's keys, or zeros past the tensor's end
        s = tl.where(offs_n[None, :] <= offs_m[:, None], tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m_i, l_i, acc = _online_step(s, v, m_i, l_i, acc)

    out = acc / l_i[:, None]  # every row saw at least one key: itself
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None],
    )


@functools.lru_cache(maxsize=8)
def _has_tma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _rows_2d(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` ``[T, H, D]`` as ``[T, H * D]`` without a copy, if a tensor descriptor can address it
    (16-byte aligned base and row stride, unit last stride); else ``None``."""
    t, h, d = x.shape
    if x.stride(2) != 1 or (h > 1 and x.stride(1) != d):
        return None
    if x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16:
        return None
    return x.as_strided((t, h * d), (x.stride(0), 1))


def contiguous_extend_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor) -> bool:
    """Whether :func:`extend_attention_contiguous` can run this pass (else the pool kernel does)."""
    if extend_mode() != "contiguous" or TensorDescriptor is None:
        return False
    d = q.shape[2]
    if q.dtype not in (torch.float16, torch.bfloat16) or not (k.dtype == v.dtype == k_buf.dtype == q.dtype):
        return False
    if d < 16 or d & (d - 1) or d > 256:
        return False
    if q.is_cuda:
        if not _has_tma(q.device.index or 0) or torch.cuda.is_current_stream_capturing():
            return False
    elif not switches.TRITON_INTERPRET.flag():
        return False
    return _rows_2d(k) is not None and _rows_2d(v) is not None


def extend_attention_contiguous(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    q_start: torch.Tensor,
    block_req: torch.Tensor,
    block_m: torch.Tensor,
    sm_scale: float,
    block_n: int = BLOCK_N,
    block_prefix: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """Causal attention of ragged new tokens over their cached prefix (``k_buf``/``v_buf``, through
    ``req_to_token``) and over each other (``k``, ``v`` ``[T, Hk, D]``, request after request as
    ``q``); fills ``out`` ``[T, Hq, D]``. Check :func:`contiguous_extend_ok` first.

    ``block_req`` / ``block_m``: :func:`triton_kernels.extend_block_table` for ``EXTEND_BLOCK_M``
    (64) queries a block, as ``TritonBackend.init_metadata`` builds it.
    Defaults: the fastest tile without a prefix at head dim 128: 32 keys a tile, 4 warps, 3
    stages (more keys, fewer stages or 8 warps were slower). 4 warps spill a few registers at head
    dim 128 and are still the fastest. ``block_prefix``: keys a tile in the prefix phase (default ``block_n``). The
    Triton backend passes :func:`extend_tiles` of the batch: 64 / 64 for prefix-heavy passes.
    """
    t, num_q_heads, head_dim = q.shape
    if t == 0:
        return out
    if EXTEND_BLOCK_M % block_n:
        raise ValueError(f"block_n {block_n} must divide {EXTEND_BLOCK_M}")
    k2, v2 = _rows_2d(k), _rows_2d(v)
    if k2 is None or v2 is None:
        raise ValueError(f"k {tuple(k.stride())} / v {tuple(v.stride())}: rows a descriptor cannot address")
    k_desc = TensorDescriptor.from_tensor(k2, [block_n, head_dim])
    v_desc = TensorDescriptor.from_tensor(v2, [block_n, head_dim])
    grid = (block_req.shape[0], num_q_heads)
    _extend_contig_kernel[grid](
        q, k_desc, v_desc, k_buf, v_buf, out,
        req_to_token, req_pool_indices, prefix_lens, extend_lens, q_start, block_req, block_m,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0),
        sm_scale * _LOG2E,
        GROUP=num_q_heads // k.shape[1], HEAD_DIM=head_dim, BLOCK_M=EXTEND_BLOCK_M, BLOCK_N=block_n,
        BLOCK_P=block_prefix or block_n,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
