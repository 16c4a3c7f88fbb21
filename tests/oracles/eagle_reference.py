"""The reference EAGLE drafter: one request's tree grown node by node, a host sync per level.

:meth:`EagleDraftWorker.draft_many` drafts a whole batch at once on the device; the tests compare it
with :func:`draft`, which follows the algorithm in ``runtime/speculative/eagle.py``'s docstring
step by step, reading the worker's head, caches and settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from phloem.runtime.speculative.eagle import EagleDraftWorker, _attend
from phloem.runtime.speculative.tree import DraftTree


@dataclass
class Node:
    token: int  # target vocabulary id
    parent: int  # index into the candidate list (root = 0)
    score: float  # cumulative draft log probability
    depth: int
    temp: int = -1  # index of its K/V in the temporary tensors once expanded
    ancestors: tuple[int, ...] = ()  # temp indices of expanded ancestors (root excluded)


def draft(w: EagleDraftWorker, seq: int, root_token: int) -> DraftTree:
    """What ``w.draft_many([seq], [root_token])[0]`` must return."""
    return select(w, grow(w, seq, root_token))


@torch.inference_mode()
def grow(w: EagleDraftWorker, seq: int, root_token: int) -> list[Node]:
    """The root and every candidate, in creation order (the reference of ``_grow_many``)."""
    k_c, v_c = w.cache.get(seq)
    committed = k_c.shape[0]
    root_pos = w.offset.get(seq, 0) + committed - 1
    root_g = w.root_feature(seq)[None]
    nodes = [Node(root_token, -1, 0.0, 0)]
    frontier = children(w, nodes, [0], *w._top(root_g, w.topk))
    parent_feature = root_g.expand(len(frontier), -1)
    temp_k = k_c.new_empty((0, *k_c.shape[1:]))
    temp_v = temp_k
    for _ in range(w.num_steps - 1):
        if not frontier:
            break
        ids = torch.tensor([nodes[i].token for i in frontier], device=k_c.device)
        positions = torch.tensor([root_pos + nodes[i].depth for i in frontier], device=k_c.device)
        x, q, k, v = w.head.project(F.embedding(ids, w.embed_weight), parent_feature, positions)
        base = temp_k.shape[0]
        temp_k, temp_v = torch.cat([temp_k, k]), torch.cat([temp_v, v])
        mask = torch.zeros(len(frontier), committed + temp_k.shape[0], dtype=torch.bool, device=k_c.device)
        mask[:, :committed] = True
        for row, i in enumerate(frontier):
            node = nodes[i]
            node.temp = base + row
            node.ancestors = nodes[node.parent].ancestors + (
                (nodes[node.parent].temp,) if node.parent != 0 else ()
            )
            mask[row, [committed + t for t in (*node.ancestors, node.temp)]] = True
        g = w.head.finish(x, _attend(q, torch.cat([k_c, temp_k]), torch.cat([v_c, temp_v]), mask))
        new = children(w, nodes, frontier, *w._top(g, w.topk))
        # expand the topk best new nodes next, each with its parent's predicted feature
        row_of = {i: r for r, i in enumerate(frontier)}
        frontier = sorted(new, key=lambda i: -nodes[i].score)[: w.topk]
        parent_feature = g[[row_of[nodes[i].parent] for i in frontier]] if frontier else g[:0]
    return nodes


def children(
    w: EagleDraftWorker, nodes: list[Node], parents: list[int], top: torch.Tensor, idx: torch.Tensor
) -> list[int]:
    """Add the ``topk`` best children of each parent (rows of ``w._top``); returns their indices."""
    tokens = w.token_map[idx].tolist()
    scores = top.tolist()
    added = []
    for row, p in enumerate(parents):
        for j in range(w.topk):
            nodes.append(Node(tokens[row][j], p, nodes[p].score + scores[row][j], nodes[p].depth + 1))
            added.append(len(nodes) - 1)
    return added


def select(w: EagleDraftWorker, nodes: list[Node]) -> DraftTree:
    """Root + the ``num_draft_tokens - 1`` best nodes by cumulative log prob. A child never scores
    above its parent and the sort is stable over creation order, so the kept set is closed under
    taking parents."""
    order = sorted(range(1, len(nodes)), key=lambda i: -nodes[i].score)[: w.num_draft_tokens - 1]
    keep = [0, *sorted(order)]
    new_index = {old: new for new, old in enumerate(keep)}
    return DraftTree(
        tokens=[nodes[i].token for i in keep],
        parents=[-1, *(new_index[nodes[i].parent] for i in keep[1:])],
    )
