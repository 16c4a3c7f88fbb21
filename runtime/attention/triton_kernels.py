"""Triton kernels for paged attention over ``req_to_token`` (used by the ``triton`` backend).

Both kernels read K/V straight from the pool, one slot per token, through the request's row of
``req_to_token``; nothing is gathered into a contiguous copy first. GQA: query head ``h`` reads KV
head ``h // group`` (the ``repeat_interleave`` convention of ``enable_gqa``).

Extend, as a plain loop (``s_r = prefix_lens[r]``, ``e_r = extend_lens[r]``)::

    for r, h, i in requests x q_heads x range(e_r):
        keys = req_to_token[r, 0 : s_r + i + 1]           # cached prefix + new tokens up to i
        out[start_r + i, h] = softmax(q . K[keys, h // group] * scale) @ V[keys, h // group]

K and V may be fp8 (``torch.float8_e4m3fn``) with per-tensor scales: ``K = K_fp8 * k_scale``.
The kernels load the stored values, convert them (exactly) to the dot's dtype and fold the scales
in where they cost nothing: ``k_scale`` into the softmax scale, ``v_scale`` into the final
normalisation (``out = acc * v_scale / l``). Pools of other dtypes pass 1.0: two exact
multiplications, nothing else changes for them.

Decode is the case ``e_r == 1`` split along the keys: ``num_splits`` programs per (request,
KV head) each reduce one chunk of the row to a normalised partial output and its log-sum-exp; a
second kernel merges the chunks::

    out = sum_s exp(lse_s - lse) * o_s,   lse = log(sum_s exp(lse_s))

No launch needs a host value derived from device data (no ``.item()``), so decode can be captured
in a CUDA graph: grids depend on the batch size and the model shape only. On Hopper both decode
kernels launch with programmatic dependent launch (:mod:`phloem.runtime.layers.pdl`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from phloem.runtime import switches
from phloem.runtime.layers.fused_triton import check_kv_write, to_fp8
from phloem.runtime.layers.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait

__all__ = [
    "NewTokenKV",
    "decode_attention",
    "decode_num_splits",
    "decode_scratch",
    "extend_attention",
    "extend_block_table",
]

_MAX_SPLITS = 16
_TARGET_PROGRAMS = 2 * 132  # two waves on an H100/H200 (132 SMs); fine elsewhere too
_TARGET_PROGRAMS_WIDE = 1024  # head dim 128: programs per launch the split sweep favoured
_MIN_SPLITS = 3
_MIN_SPLITS_FULL = 2  # head dim 128, from _TARGET_PROGRAMS_WIDE (request, KV head) pairs
_WIDE_TILE = (128, 4, 2)  # head dim 128, 16-bit K/V: keys a loop step, warps, stages
_WIDE_TILE_MIN_PAIRS = 512  # ... from this many (request, KV head) pairs
_MERGE_GROUPED_MIN_PAIRS = 132  # (request, KV head) pairs from which a merge program takes a whole group
# With the step's token in the decode kernel (NewTokenKV), grids of fewer (request, KV head) pairs
# than this read their first block of keys before the PDL wait (0: never; read on first call).
@functools.cache
def _prefetch_max_pairs() -> int:
    return switches.DECODE_PREFETCH_PAIRS.number()


# The decode split kernel's program order (see decode_attention); read on first call.
@functools.cache
def _heads_first() -> bool:
    return switches.DECODE_ORDER.text() != "requests"


@triton.jit
def _attend_block(
    q, m_i, l_i, acc, k_ptr, v_ptr, slots, valid, kv_head,
    stride_kt, stride_kh, stride_vt, stride_vh,
    offs_d, d_mask, sm_scale,
    FP32_DOT: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over a block of keys. ``valid``: [M, N] mask of visible keys.

    K/V are converted from their storage dtype (fp8 included) to the dot's; ``sm_scale`` already
    holds K's dequantization scale and the caller applies V's to the final output.
    """
    n_mask = tl.max(valid.to(tl.int32), 0) > 0  # [N] keys any row may see
    k, v = _load_kv(
        k_ptr, v_ptr, slots, n_mask, kv_head, stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_mask
    )
    return _attend_tile(q, m_i, l_i, acc, k, v, valid, sm_scale, FP32_DOT)


@triton.jit
def _load_kv(
    k_ptr, v_ptr, slots, n_mask, kv_head, stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_mask
):
    """The ``[N, BLOCK_D]`` K and V tiles of a block of slots (zeros where ``n_mask`` is off)."""
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(
        k_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
    )
    v = tl.load(
        v_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
    )
    return k, v


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k, v, valid, sm_scale, FP32_DOT: tl.constexpr):
    """:func:`_attend_block` on K/V tiles already loaded."""
    if FP32_DOT:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    s = tl.where(valid, s * sm_scale, float("-inf"))  # [M, N]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows that have seen no key yet keep m = -inf; shift them by 0 to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    req_to_token_ptr, req_idx_ptr, prefix_lens_ptr, extend_lens_ptr, q_start_ptr,
    block_req_ptr, block_m_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_rtt,
    sm_scale, k_scale, v_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr, F16_DOT: tl.constexpr,
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
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < ext
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    if F16_DOT:  # as in the decode kernel: fp8 K/V widen to float16 cheaply, bf16 q fits it
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    q_pos = prefix + offs_m  # [M] absolute positions
    qk_scale = sm_scale * k_scale  # dequantizes K for free

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(prefix + (m_blk + 1) * BLOCK_M, prefix + ext)  # keys 0 .. last query's position
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_row = offs_n < end
        slots = tl.load(req_to_token_ptr + row * stride_rtt + offs_n, mask=in_row, other=0)
        valid = (offs_n[None, :] <= q_pos[:, None]) & in_row[None, :] & m_mask[:, None]
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, k_ptr, v_ptr, slots, valid, kv_head,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_mask, qk_scale, FP32_DOT,
        )  # fmt: skip
    out = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _rope_rows(ptrs, mask, partner_off, cos, sin, lower, w_ptr, w_cols, eps,
               HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, AXIS: tl.constexpr):  # fmt: skip
    """RoPE (rotate-half) of head rows loaded whole: ``ptrs`` [..., BLOCK_D] point at the rows'
    elements, ``ptrs + partner_off`` at each element's partner in the other half; ``cos``/``sin``
    are indexed by column (the table repeated over both halves), ``lower`` marks the first half.
    With ``HAS_NORM`` each row (along axis ``AXIS``) is RMS-normalized first (weight at
    ``w_ptr + w_cols``) and rounded to the dtype, as ``rope_store_`` does. Returns the rotated rows
    in the input's dtype."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(ptrs + partner_off, mask=mask, other=0.0).to(tl.float32)
    dtype = ptrs.dtype.element_ty
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=AXIS, keep_dims=True) / HEAD_DIM + eps)
        w = tl.load(w_ptr + w_cols, mask=w_cols < HEAD_DIM, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + w_cols + partner_off, mask=w_cols < HEAD_DIM, other=0.0).to(tl.float32)
        x = (x * rstd * w).to(dtype).to(tl.float32)
        xp = (xp * rstd * wp).to(dtype).to(tl.float32)
    return (x * cos + tl.where(lower, -xp, xp) * sin).to(dtype)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, part_o_ptr, part_lse_ptr,
    req_to_token_ptr, req_idx_ptr, seq_lens_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rtt,
    sm_scale, k_scale, v_scale,
    nk_ptr, nv_ptr, cos_ptr, sin_ptr, slots_ptr, qn_ptr, kn_ptr, eps,
    stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_cos, stride_sin,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, FP32_DOT: tl.constexpr, F16_DOT: tl.constexpr, PDL: tl.constexpr,
    HEADS_FIRST: tl.constexpr, ROPE: tl.constexpr, HAS_NORM: tl.constexpr, QUANT: tl.constexpr,
    PREFETCH: tl.constexpr,
):  # fmt: skip
    # grid: (requests, kv heads, splits), or (kv heads, requests, splits) with HEADS_FIRST; one
    # program serves all GROUP query heads of its KV head. With ROPE the step's token is not in
    # the pool yet: q (un-rotated) and the new k are rotated here (per-head norms first with
    # HAS_NORM); the program whose split holds the new key starts its softmax from it, from
    # registers, and writes its K and V to the pool (fp8 with QUANT), as rope_store_ would have.
    pdl_trigger(PDL)
    if not PREFETCH:
        pdl_wait(PDL)
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    row = tl.load(req_idx_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N  # whole blocks per split
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    if ROPE:
        holds_new = (start <= seq_len - 1) & (seq_len - 1 < end)
        end = tl.minimum(end, seq_len - 1)  # the pool's keys
    if PREFETCH:
        # With ROPE no kernel of this step writes what the pool's keys of this split are read
        # from (the step's token is written here, after the wait): the lengths and slots come
        # from the step's inputs, the keys from earlier steps. So the first block is read
        # before the wait (PDL), while the kernels before this one still run.
        offs_n0 = start + tl.arange(0, BLOCK_N)
        in_row0 = offs_n0 < end
        slots0 = tl.load(req_to_token_ptr + row * stride_rtt + offs_n0, mask=in_row0, other=0)
        k0, v0 = _load_kv(k_ptr, v_ptr, slots0, in_row0, kv_head, stride_kt, stride_kh, stride_vt, stride_vh,
                          offs_d, d_mask)  # fmt: skip
        pdl_wait(PDL)
    heads = kv_head * GROUP + offs_h
    q_tile = q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    if ROPE:
        half = HEAD_DIM // 2
        lower = offs_d < half
        partner = tl.where(lower, half, -half)  # offset of each element's rotation partner
        col = tl.where(lower, offs_d, offs_d - half)
        cos = tl.load(cos_ptr + b.to(tl.int64) * stride_cos + col, mask=d_mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + b.to(tl.int64) * stride_sin + col, mask=d_mask, other=0.0).to(tl.float32)
        q = _rope_rows(q_tile, h_mask[:, None] & d_mask[None, :], partner[None, :], cos[None, :],
                       sin[None, :], lower[None, :], qn_ptr, offs_d[None, :], eps, HEAD_DIM, HAS_NORM, 1)  # fmt: skip
        nk = _rope_rows(nk_ptr + b.to(tl.int64) * stride_nkt + kv_head * stride_nkh + offs_d, d_mask,
                        partner, cos, sin, lower, kn_ptr, offs_d, eps, HEAD_DIM, HAS_NORM, 0)  # fmt: skip
        nv = tl.load(
            nv_ptr + b.to(tl.int64) * stride_nvt + kv_head * stride_nvh + offs_d, mask=d_mask, other=0.0
        )
        if QUANT:  # what the pool will hold, and what a later step reads back
            nk = to_fp8(nk, k_scale, k_ptr.dtype.element_ty)
            nv = to_fp8(nv, v_scale, v_ptr.dtype.element_ty)
        nk = nk.to(k_ptr.dtype.element_ty)
        nv = nv.to(v_ptr.dtype.element_ty)
    else:
        q = tl.load(q_tile, mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    if F16_DOT:  # fp8 K/V widen to float16 in one instruction per pair; bf16 q fits it exactly
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    qk_scale = sm_scale * k_scale  # dequantizes K for free
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if ROPE:
        if holds_new:
            # the softmax starts from it (nothing of it stays live through the loop), with the
            # loop's roundings: key and value as the pool holds them, in the dot's dtype; p = 1
            m_i = tl.sum(q.to(tl.float32) * nk.to(q.dtype).to(tl.float32)[None, :], 1) * qk_scale
            l_i = tl.full([BLOCK_H], 1.0, tl.float32)
            acc = acc + nv.to(q.dtype).to(tl.float32)[None, :]
            # no program of this launch reads the new slot: the key came from registers
            slot = tl.load(slots_ptr + b).to(tl.int64)
            tl.store(k_ptr + slot * stride_kt + kv_head * stride_kh + offs_d, nk, mask=d_mask)
            tl.store(v_ptr + slot * stride_vt + kv_head * stride_vh + offs_d, nv, mask=d_mask)
    if PREFETCH:
        valid0 = in_row0[None, :] & (offs_h[:, None] >= 0)  # [H, N]
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k0, v0, valid0, qk_scale, FP32_DOT)
        start += BLOCK_N
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_row = offs_n < end
        slots = tl.load(req_to_token_ptr + row * stride_rtt + offs_n, mask=in_row, other=0)
        valid = in_row[None, :] & (offs_h[:, None] >= 0)  # [H, N]
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, k_ptr, v_ptr, slots, valid, kv_head,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_mask, qk_scale, FP32_DOT,
        )  # fmt: skip
    # part_o: [B, Hq, NUM_SPLITS, BLOCK_D] float32, part_lse: [B, Hq, NUM_SPLITS]
    empty = l_i == 0.0
    o = acc * v_scale / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    base = (b * NUM_Q_HEADS + heads) * NUM_SPLITS + split  # [H]
    tl.store(part_lse_ptr + base, lse, mask=h_mask)
    tl.store(part_o_ptr + base[:, None] * BLOCK_D + offs_d[None, :], o, mask=h_mask[:, None])


@triton.jit
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, seq_lens_ptr, stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr, HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # grid: (requests, query heads / HEADS); a program merges HEADS query heads (a KV head's group
    # when there are many programs, one head when there are few), adding the splits in order. Only
    # the splits the split kernel gave keys are read: the others hold an empty partial (weight 0),
    # so skipping them changes no bit, and a short context reads a few of many splits.
    pdl_trigger(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < HEADS
    heads = tl.program_id(1) * HEADS + offs_h
    seq_len = tl.load(seq_lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N  # as the split kernel cuts them
    used = tl.cdiv(seq_len, tl.maximum(chunk, 1))
    first = (b * NUM_Q_HEADS + heads) * NUM_SPLITS  # [H]: each head's split 0
    lse_all = tl.load(
        part_lse_ptr + first[:, None] + offs_s[None, :],
        mask=h_mask[:, None] & (offs_s < used)[None, :],
        other=float("-inf"),
    )
    m = tl.where(h_mask, tl.max(lse_all, 1), 0.0)  # finite on live heads: split 0 holds key 0
    num = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        live = h_mask & (offs_h * 0 + s < used)  # (a tensor compare: the interpreter wants one)
        w = tl.exp(tl.load(part_lse_ptr + first + s, mask=live, other=float("-inf")) - m)  # 0: no key
        part = tl.load(
            part_o_ptr + (first + s)[:, None] * BLOCK_D + offs_d[None, :], mask=live[:, None], other=0.0
        )
        num += part * w[:, None]
        den += w
    out = num / tl.where(h_mask, den, 1.0)[:, None]
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


# ---- launchers --------------------------------------------------------------------------------
EXTEND_BLOCK_M = 64


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def extend_block_table(
    extend_lens: torch.Tensor, num_tokens: int, block_m: int = EXTEND_BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map every program of the extend grid to ``(request, query block)`` on the device, no sync.

    The grid has ``cdiv(num_tokens, BLOCK_M) + batch`` programs, an upper bound on
    ``sum_r cdiv(extend_lens[r], BLOCK_M)``; spare programs get request ``-1`` and exit at once.
    ``block_m`` must be the ``BLOCK_M`` the kernel is launched with.
    """
    cap = triton.cdiv(num_tokens, block_m) + extend_lens.shape[0]
    blocks = (extend_lens + block_m - 1) // block_m  # [B]
    ends = torch.cumsum(blocks, 0)  # [B] inclusive
    j = torch.arange(cap, device=extend_lens.device)
    req = torch.searchsorted(ends, j, right=True)  # [cap] request owning program j
    used = j < ends[-1] if ends.numel() else torch.zeros_like(j, dtype=torch.bool)
    req = req.clamp(max=max(extend_lens.shape[0] - 1, 0))
    m_blk = j - (ends - blocks)[req]
    return torch.where(used, req, -1), m_blk


def extend_attention(
    q: torch.Tensor,
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    block_size_m: int = EXTEND_BLOCK_M,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    f16_dot: bool | None = None,
) -> torch.Tensor:
    """Causal attention of ragged new tokens over their paged rows; fills ``out`` ``[T, Hq, D]``.

    The new tokens' K/V must already be in ``k_buf``/``v_buf`` at their slots. ``k_scale``,
    ``v_scale``: dequantization scales of an fp8 pool (``KVPool.get_kv_scales``).
    ``block_size_m`` (queries per program: the one ``block_req`` / ``block_m`` were built for by
    :func:`extend_block_table`), ``block_n``, ``num_warps``, ``num_stages``: tuning knobs.
    ``f16_dot``: as in :func:`decode_attention` (on by
    default for an fp8 pool read by a bfloat16 query).
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    group = num_q_heads // k_buf.shape[1]
    fp32 = q.dtype == torch.float32
    block_d = _block_d(head_dim)
    # an fp8 pool reads half the bytes per key: 64 keys a step for head dim 128 as well
    fp8 = k_buf.element_size() == 1
    if f16_dot is None:
        f16_dot = fp8 and q.dtype == torch.bfloat16
    block_n = block_n or (32 if (fp32 or (block_d > 64 and not fp8)) else 64)
    grid = (block_req.shape[0], num_q_heads)
    _extend_kernel[grid](
        q, k_buf, v_buf, out,
        req_to_token, req_pool_indices, prefix_lens, extend_lens, q_start,
        block_req, block_m,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0),
        sm_scale, k_scale, v_scale,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_size_m, BLOCK_N=block_n, FP32_DOT=fp32, F16_DOT=bool(f16_dot) and not fp32,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


class NewTokenKV(NamedTuple):
    """The decode step's own token, for :func:`decode_attention` to rotate and store (``B``
    requests, one token each): ``k``, ``v`` ``[B, Hk, D]`` as the qkv projection left them (any
    row stride, contiguous last axis), RoPE tables ``cos``, ``sin`` ``[B, 1, D/2]`` (rotate-half
    layout), the pool ``slots`` ``[B]`` they go to, and Qwen3's per-head norms before the rotation
    (``(q_weight, k_weight, eps)``, weights ``[D]``) or ``None``."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None

    def check(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, k_scale: float, v_scale: float
    ) -> None:
        """Raise ``ValueError`` unless these tensors fit ``q`` and the pool (as ``rope_store_``'s)."""
        check_kv_write(
            q, self.k, self.v, self.cos, self.sin, k_buf, v_buf, self.slots, self.qk_norm, k_scale, v_scale
        )


def decode_num_splits(batch_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Key-axis splits per (request, KV head): enough programs to fill the chip, at most 16.

    Depends on shapes only, so a captured graph keeps the same value on replay. Heads of 128 and
    more split every request at least three ways: a batch of mixed context lengths (any served
    batch) otherwise leaves SMs idle behind its longest requests, while contexts of one length
    lose a little to the extra merge. From :data:`_TARGET_PROGRAMS_WIDE` (request, KV head) pairs
    two splits suffice: the grid is full anyway, and each split's merge costs. Smaller heads keep
    the plain rule.
    """
    work = max(1, batch_size * num_kv_heads)
    if head_dim >= 128:
        least = _MIN_SPLITS_FULL if work >= _TARGET_PROGRAMS_WIDE else _MIN_SPLITS
        return max(least, min(_MAX_SPLITS, triton.cdiv(_TARGET_PROGRAMS_WIDE, work)))
    return max(1, min(_MAX_SPLITS, triton.cdiv(_TARGET_PROGRAMS, work)))


def decode_scratch(
    batch_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``part_o`` ``[B, Hq, S, BLOCK_D]`` and ``part_lse`` ``[B, Hq, S]`` float32 scratch of
    :func:`decode_attention`, with ``S`` from :func:`decode_num_splits`."""
    splits = decode_num_splits(batch_size, num_kv_heads, head_dim)
    part_o = torch.empty(
        (batch_size, num_q_heads, splits, _block_d(head_dim)), dtype=torch.float32, device=device
    )
    part_lse = torch.empty((batch_size, num_q_heads, splits), dtype=torch.float32, device=device)
    return part_o, part_lse


def decode_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
    out: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor,
    *,
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
    sm_scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
    block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    f16_dot: bool | None = None, heads_first: bool | None = None, merge_grouped: bool | None = None,
    new_kv: NewTokenKV | None = None, prefetch: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """One query per request over ``req_to_token[r, :seq_lens[r]]``; fills ``out`` ``[B, Hq, D]``.

    ``part_o`` ``[B, Hq, S, BLOCK_D]`` and ``part_lse`` ``[B, Hq, S]`` (float32) are scratch, with
    ``S`` from :func:`decode_num_splits`. ``k_scale``, ``v_scale``: as in :func:`extend_attention`.
    ``block_n``, ``num_warps``, ``num_stages``: tuning knobs (defaults: :func:`_split_tile`).
    None of these options changes a result:

    - ``f16_dot`` (default: an fp8 pool read by a bfloat16 query): both dots in float16, to which
      e4m3 widens in one instruction per pair (a bfloat16 query converts exactly up to 65,504).
    - ``heads_first`` (default on; ``PHLOEM_DECODE_ORDER=requests``: off): programs that run side
      by side read the heads of the same tokens, whose K (and V) is one contiguous row.
    - ``merge_grouped``: a merge program takes a KV head's whole group of query heads (the default
      from :data:`_MERGE_GROUPED_MIN_PAIRS` pairs) or one query head (a small grid fills the SMs).
    - ``new_kv``: the step's token is neither rotated nor stored yet (:class:`NewTokenKV`); the
      split kernel rotates ``q`` in registers, reads the new K/V from ``new_kv`` and stores them,
      a launch and a round trip through memory fewer per layer than ``rope_store_`` first.
    - ``prefetch`` (with ``new_kv``; default below ``PHLOEM_DECODE_PREFETCH_PAIRS`` pairs): a split
      program reads its first key block before its PDL wait, while earlier kernels still run.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    group = num_q_heads // num_kv_heads
    num_splits = part_lse.shape[2]
    fp32 = q.dtype == torch.float32
    fp8 = k_buf.element_size() == 1
    if f16_dot is None:
        f16_dot = fp8 and q.dtype == torch.bfloat16
    block_d = _block_d(head_dim)
    tile = _split_tile(block_d, fp32, fp8, batch * num_kv_heads, block_n, num_warps, num_stages)
    pdl = pdl_enabled(q.device)
    if heads_first is None:
        heads_first = _heads_first()
    grid = (num_kv_heads, batch, num_splits) if heads_first else (batch, num_kv_heads, num_splits)
    if prefetch is None:
        prefetch = batch * num_kv_heads < _prefetch_max_pairs()
    prefetch = prefetch and new_kv is not None
    if new_kv is not None:
        new_kv.check(q, k_buf, v_buf, k_scale, v_scale)
    nk, nv, cos, sin, slots, qn, kn, eps = _new_kv_args(q, new_kv)
    _decode_split_kernel[grid](
        q, k_buf, v_buf, part_o, part_lse,
        req_to_token, req_pool_indices, seq_lens,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0),
        sm_scale, k_scale, v_scale,
        nk, nv, cos, sin, slots, qn, kn, eps,
        nk.stride(0), nk.stride(1), nv.stride(0), nv.stride(1), cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=num_q_heads, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=tile.block_n,
        NUM_SPLITS=num_splits, FP32_DOT=fp32, F16_DOT=bool(f16_dot) and not fp32, PDL=pdl,
        HEADS_FIRST=heads_first, ROPE=new_kv is not None,
        HAS_NORM=new_kv is not None and new_kv.qk_norm is not None, QUANT=new_kv is not None and fp8,
        PREFETCH=prefetch, num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_kwargs(pdl),
    )  # fmt: skip
    if merge_grouped is None:
        merge_grouped = batch * num_kv_heads >= _MERGE_GROUPED_MIN_PAIRS
    heads = group if merge_grouped else 1
    _decode_merge_kernel[(batch, num_q_heads // heads)](
        part_o, part_lse, out, seq_lens, out.stride(0), out.stride(1),
        NUM_Q_HEADS=num_q_heads, HEADS=heads, BLOCK_H=max(2, triton.next_power_of_2(heads)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_N=tile.block_n, PDL=pdl,
        num_warps=2, **launch_kwargs(pdl),
    )  # fmt: skip
    return out


class _Tile(NamedTuple):
    block_n: int  # keys a loop step
    num_warps: int
    num_stages: int


def _split_tile(
    block_d: int, fp32: bool, fp8: bool, pairs: int, block_n: int | None, num_warps: int | None,
    num_stages: int | None,
) -> _Tile:
    """The split kernel's tile: the caller's values where given, else the defaults. Head dim 128
    with 16-bit K/V takes :data:`_WIDE_TILE` from :data:`_WIDE_TILE_MIN_PAIRS` (request, KV head)
    pairs, where more keys a step pay; fp8 K/V take 128 keys a step for head dim 128 (the bytes of
    64 16-bit keys), float32 32 keys and 8 warps."""
    wide = block_d >= 128 and not fp32 and not fp8 and pairs >= _WIDE_TILE_MIN_PAIRS
    return _Tile(
        block_n or (_WIDE_TILE[0] if wide else 32 if fp32 else 128 if fp8 and block_d >= 128 else 64),
        num_warps or (_WIDE_TILE[1] if wide else 4 if block_d < 128 or fp8 else 8 if fp32 else 2),
        num_stages or (_WIDE_TILE[2] if wide else 3 if block_d >= 128 and not fp32 else 2),
    )


def _new_kv_args(q: torch.Tensor, new_kv: NewTokenKV | None) -> tuple[Any, ...]:
    """The split kernel's step-token arguments: ``(k, v, cos, sin, slots, q_norm, k_norm, eps)``
    of ``new_kv``, or unused pointers (``q``) without it."""
    if new_kv is None:
        return q, q, q, q, q, q, q, 0.0
    qn, kn, eps = new_kv.qk_norm if new_kv.qk_norm is not None else (q, q, 0.0)
    return new_kv.k, new_kv.v, new_kv.cos, new_kv.sin, new_kv.slots, qn, kn, eps
