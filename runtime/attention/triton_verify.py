"""Tree-verify attention in Triton: every request's draft tree in one launch (docs/design.md §7).

Layout: ``B`` requests, each with exactly ``N`` tree nodes (shorter trees are padded), flat::

    q, out:     [B * N, Hq, D]        node i of request b is row b * N + i
    node_slots: [B * N]               KV slot of each node (padding nodes: the padding slot)
    tree_mask:  [B, N, N] bool        tree_mask[b, i, j]: node i sees node j (ancestors and itself)

Node ``i`` of request ``b`` attends ``req_to_token[req_pool_indices[b], 0 : prefix_lens[b]]`` (the
request's cached tokens) and then the nodes its mask row allows. One program per (request, query
head) walks the cached keys in blocks with an online softmax, then the tree's keys as one last
block. Grid and shapes depend on ``B``, ``N`` and the model only, so the launch is captured in the
speculative verify graphs. :func:`tree_verify_reference` is the plain-torch oracle. On Hopper it
takes part in programmatic dependent launch (:mod:`phloem.runtime.layers.pdl`), as the decode
kernels around it in a verify pass do.

fp8 pools follow ``triton_kernels``: ``k_scale`` folds into the softmax scale, ``v_scale`` into
the final normalisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from phloem.runtime.attention.triton_kernels import _attend_block
from phloem.runtime.layers.pdl import launch_kwargs, pdl_enabled, pdl_trigger, pdl_wait

__all__ = ["tree_verify_attention", "tree_verify_reference"]


@triton.jit
def _tree_verify_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    req_to_token_ptr, req_idx_ptr, prefix_lens_ptr, node_slots_ptr, tree_mask_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_rtt,
    sm_scale, k_scale, v_scale,
    NODES: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_trigger(PDL)
    pdl_wait(PDL)  # everything this kernel reads (q, the pool, the tables) earlier kernels write
    b = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    row = tl.load(req_idx_ptr + b)
    prefix = tl.load(prefix_lens_ptr + b)

    offs_m = tl.arange(0, BLOCK_M)  # node index within the tree (queries, and keys of the tree)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < NODES
    d_mask = offs_d < HEAD_DIM
    q_rows = (b * NODES + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    qk_scale = sm_scale * k_scale

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, prefix, BLOCK_N):  # the cached prefix: every node sees all of it
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_row = offs_n < prefix
        slots = tl.load(req_to_token_ptr + row * stride_rtt + offs_n, mask=in_row, other=0)
        valid = in_row[None, :] & m_mask[:, None]
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, k_ptr, v_ptr, slots, valid, kv_head,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_mask, qk_scale, FP32_DOT,
        )  # fmt: skip
    # the tree itself: keys are the nodes' own slots, visibility from the mask
    tree_slots = tl.load(node_slots_ptr + b * NODES + offs_m, mask=m_mask, other=0)
    pair = m_mask[:, None] & m_mask[None, :]
    seen = tl.load(
        tree_mask_ptr + b * NODES * NODES + offs_m[:, None] * NODES + offs_m[None, :], mask=pair, other=0
    )
    m_i, l_i, acc = _attend_block(
        q, m_i, l_i, acc, k_ptr, v_ptr, tree_slots, (seen != 0) & pair, kv_head,
        stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_mask, qk_scale, FP32_DOT,
    )  # fmt: skip
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # every real node sees itself; rows past NODES see nothing
    out = acc * (v_scale / l_safe[:, None])
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def tree_verify_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    node_slots: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Fill ``out`` ``[B * N, Hq, D]`` (module docstring); the nodes' K/V must be in the pool."""
    batch, nodes = tree_mask.shape[0], tree_mask.shape[1]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    group = num_q_heads // k_buf.shape[1]
    fp32 = q.dtype == torch.float32
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = max(16, triton.next_power_of_2(nodes))
    block_n = 32 if (fp32 or block_d > 64) else 64
    if tree_mask.dtype == torch.bool:
        tree_mask = tree_mask.view(torch.int8)  # same bytes; Triton loads int8 more plainly than i1
    pdl = pdl_enabled(q.device)
    _tree_verify_kernel[(batch, num_q_heads)](
        q, k_buf, v_buf, out,
        req_to_token, req_pool_indices, prefix_lens, node_slots, tree_mask,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0),
        sm_scale, k_scale, v_scale,
        NODES=nodes, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n, FP32_DOT=fp32, PDL=pdl, **launch_kwargs(pdl),
    )  # fmt: skip
    return out


def tree_verify_reference(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    node_slots: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Plain-torch oracle of :func:`tree_verify_attention`: one dense masked attention per request."""
    batch, nodes = tree_mask.shape[0], tree_mask.shape[1]
    out = torch.empty_like(q)
    for b in range(batch):
        row, prefix = int(req_pool_indices[b]), int(prefix_lens[b])
        keys = torch.cat([req_to_token[row, :prefix], node_slots[b * nodes : (b + 1) * nodes]])
        k = k_buf[keys].to(q.dtype) * k_scale  # [S, Hk, D]
        v = v_buf[keys].to(q.dtype) * v_scale
        mask = torch.cat([torch.ones(nodes, prefix, dtype=torch.bool, device=q.device), tree_mask[b]], 1)
        o = F.scaled_dot_product_attention(
            q[b * nodes : (b + 1) * nodes].transpose(0, 1)[None], k.transpose(0, 1)[None],
            v.transpose(0, 1)[None], attn_mask=mask[None, None], scale=sm_scale, enable_gqa=True,
        )  # fmt: skip
        out[b * nodes : (b + 1) * nodes] = o[0].transpose(0, 1)
    return out
