"""Random tree-verify batches for the Triton kernel and its plain-torch oracle.

Every call draws fresh inputs: a pool with scattered slots, a ``req_to_token`` row per request
with a random cached prefix, random draft trees (each node's parent drawn among earlier nodes),
padded to the batch's node count the way the verify graphs pad (a padding node sees only
itself and writes the padding slot).
"""

from __future__ import annotations

import torch
from phloem.runtime.attention.base import ancestor_mask
from phloem.runtime.attention.triton_verify import tree_verify_reference
from phloem.runtime.cache.kv_pool import PADDING_SLOT

REL_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}

# name -> (prefix_lens, tree sizes, padded node count)
CASES = {
    "chain_b1": ([57], [4], 4),
    "tree_b3_padded": ([0, 130, 9], [8, 3, 1], 8),
    "tree16_long": ([700, 1500], [16, 11], 16),
    "batch32": ([(53 * i) % 400 + 1 for i in range(32)], [(i % 6) + 1 for i in range(32)], 6),
}
SMALL_CASES = ("chain_b1", "tree_b3_padded")
HEADS = {"gqa": (6, 2, 64), "mha": (4, 4, 32)}  # (q heads, kv heads, head dim)


def make_case(prefix_lens, sizes, nodes, heads, *, dtype, device, seed):  # noqa: ANN001, ANN201
    g = torch.Generator().manual_seed(seed)
    hq, hk, d = heads
    batch = len(prefix_lens)
    total = sum(prefix_lens) + batch * nodes + 1
    num_slots = 2 * total + 8
    perm = torch.randperm(num_slots - 1, generator=g) + 1  # never the padding slot
    k_buf = torch.randn(num_slots, hk, d, generator=g).to(dtype)
    v_buf = torch.randn(num_slots, hk, d, generator=g).to(dtype)
    width = max(prefix_lens) + nodes + 1
    req_to_token = torch.zeros(batch + 2, width, dtype=torch.int64)
    rows = torch.randperm(batch + 2, generator=g)[:batch]
    node_slots = torch.full((batch * nodes,), PADDING_SLOT, dtype=torch.int64)
    mask = torch.zeros(batch, nodes, nodes, dtype=torch.bool)
    used = 0
    for b, (p, n) in enumerate(zip(prefix_lens, sizes)):
        req_to_token[rows[b], :p] = perm[used : used + p]
        used += p
        node_slots[b * nodes : b * nodes + n] = perm[used : used + n]
        used += n
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        mask[b, :n, :n] = ancestor_mask(parents)
        mask[b, n:, n:] = torch.eye(nodes - n, dtype=torch.bool)  # padding: itself only
    q = torch.randn(batch * nodes, hq, d, generator=g).to(dtype)
    args = {
        "req_to_token": req_to_token,
        "req_pool_indices": rows.to(torch.int64),
        "prefix_lens": torch.tensor(prefix_lens, dtype=torch.int64),
        "node_slots": node_slots,
        "tree_mask": mask,
        "sm_scale": d**-0.5,
    }
    move = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    return q.to(device), k_buf.to(device), v_buf.to(device), move


def compare(case: str, heads_name: str, dtype: torch.dtype, device: str, seed: int = 0) -> float:
    """Relative error of the Triton kernel against the float64 oracle; raises past the tolerance."""
    from phloem.runtime.attention.triton_verify import tree_verify_attention

    prefix, sizes, nodes = CASES[case]
    q, k, v, args = make_case(prefix, sizes, nodes, HEADS[heads_name], dtype=dtype, device=device, seed=seed)
    out = tree_verify_attention(q, k, v, torch.empty_like(q), **args)
    ref = tree_verify_reference(q.double(), k.double(), v.double(), **args)
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < REL_TOL[dtype], f"{case} {heads_name} {dtype}: rel err {err:.2e}"
    return err
