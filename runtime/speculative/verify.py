"""Verify draft trees with one target pass, accept the longest valid path (docs/design.md §7).

One call of :meth:`TreeVerifier.verify` handles a batch. For request ``r`` with ``kv_len``
cached tokens and a draft tree of ``n`` nodes (node 0 is the newest token, whose KV is not
computed yet)::

    1. run the target once over every node of every tree (flat, requests back to back); node i
       sits at position kv_len + depth(i) and attends the cached prefix + its ancestors + itself;
       its K/V is written at the caller-allocated slot ``slots[i]``
    2. logits per node -> accept a root-to-leaf path (greedy or rejection sampling) and one
       more token from the target at the path's end (the bonus token)
    3. commit: the path's nodes become positions kv_len, kv_len + 1, ... of the request's
       req_to_token row (slot numbers move, KV does not); every other node's slot is returned

so one verify yields ``accept_length = len(tokens) >= 1`` tokens, and the request's KV grows by
the same amount (the last new token's KV is computed by the next step, as in plain decoding).

Acceptance rules, with ``p_u`` the target distribution at node ``u``:

- greedy: ``t = argmax p_u``; move to the child of ``u`` whose token is ``t`` if there is one,
  else stop and emit ``t``. The output equals plain greedy decoding token for token.
- sampling (recursive speculative sampling): at ``u``, try the children in order. Child token
  ``x`` drawn from ``q`` (``tree.draft_probs[u]``; a point mass on ``x`` when the drafter chose
  it deterministically) is accepted with probability ``min(1, p(x) / q(x))``; on rejection
  ``p <- normalize(max(p - q, 0))`` and the next child is tried against that residual. When no
  child is accepted, emit a draw from the residual. Each emitted token is thus distributed
  exactly as ``p_u`` (for one child this is the standard speculative sampling rule; with point
  masses it reads "is it x1? else is it x2? ...", sampling without replacement from p).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from phloem.grammars.bitmask import apply_bitmask
from phloem.runtime.attention.base import AttentionBackend, ancestor_mask, varying_shape_sdpa
from phloem.runtime.attention.cpu import CpuRowsAttention, decodes_in_rows
from phloem.runtime.forward_io import ForwardMode
from phloem.runtime.host_copy import to_device
from phloem.runtime.sampling.sampler import GREEDY_EPS, min_p_drop_mask, top_k_top_p_drop_mask
from phloem.runtime.speculative.tree import DraftTree

__all__ = [
    "CpuTreeVerifyAttention",
    "SpecSampling",
    "TreeVerifier",
    "TreeVerifyAttention",
    "VerifyRequest",
    "VerifyResult",
    "accept_greedy",
    "accept_sampling",
    "target_probs",
]


@dataclass(frozen=True)
class SpecSampling:
    """Sampling parameters of one request, as the acceptance rule needs them."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1


GREEDY = SpecSampling()


@dataclass
class VerifyRequest:
    """One request's part of a verify pass.

    ``slots`` ``[len(tree)]`` are fresh KV slots the caller allocated for the nodes; after the
    pass the accepted ones belong to the request's row and the rest come back in
    :attr:`VerifyResult.free_slots`. ``max_accept`` caps the tokens taken (remaining budget).
    ``bitmask`` (constrained requests, see :mod:`phloem.runtime.speculative.grammar`) masks each
    node's logits before acceptance.
    """

    req_pool_idx: int
    kv_len: int
    tree: DraftTree
    slots: torch.Tensor
    sampling: SpecSampling = GREEDY
    max_accept: int | None = None
    bitmask: torch.Tensor | None = None  # grammar mask per node, int32 [len(tree), words]


@dataclass
class VerifyResult:
    """Outcome for one request.

    ``tokens``: accepted draft tokens then the bonus token. ``nodes``: tree nodes whose KV was
    committed (root first; same length as ``tokens``). ``hidden``: the target's final hidden
    states at those nodes ``[len(tokens), H]`` (the EAGLE draft's features).
    """

    tokens: list[int]
    nodes: list[int]
    free_slots: torch.Tensor
    hidden: torch.Tensor

    @property
    def accept_length(self) -> int:
        """Tokens gained by this verify (accepted drafts + 1)."""
        return len(self.tokens)


# ---------------------------------------------------------------------------------- attention
class TreeVerifyAttention(AttentionBackend):
    """Reference tree-mask attention over the paged KV pool (plain torch, one call per request).

    For request ``r``: keys are ``req_to_token[row, :kv_len]`` followed by the tree's own slots;
    the mask is ``[ones(n, kv_len) | ancestor_mask(parents)]``.
    """

    def plan(self, reqs: Sequence[VerifyRequest]) -> None:
        """Set this pass's layout (replaces any previous one)."""
        table = self.req_to_token_pool.req_to_token
        device = table.device
        self.mode = ForwardMode.TARGET_VERIFY  # the base forward() routes to forward_verify
        self.out_slots = torch.cat([r.slots for r in reqs]).to(device)
        self.verify_plan: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        start = 0
        for r in reqs:
            n = len(r.tree)
            keys = torch.cat([table[r.req_pool_idx, : r.kv_len], r.slots.to(device)])  # [kv_len + n]
            prefix = torch.ones(n, r.kv_len, dtype=torch.bool, device=device)
            mask = torch.cat([prefix, ancestor_mask(r.tree.parents, device)], dim=1)  # [n, kv_len + n]
            self.verify_plan.append((start, n, keys, mask[None, None]))
            start += n

    def init_metadata(self, forward_input) -> None:  # noqa: ANN001 - not used by this backend
        raise NotImplementedError("TreeVerifyAttention is set up with plan(), not from a ForwardInput")

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return self.forward_verify(q, k, v, layer)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return self.forward_verify(q, k, v, layer)

    def forward_verify(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        self.kv_pool.set_kv(layer, self.out_slots, k, v)
        out = torch.empty_like(q)
        for start, n, keys, mask in self.verify_plan:
            q_r = q[start : start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
            k_s, v_s = self.kv_pool.gather_kv(layer, keys, q.dtype)  # [S, Hk, D], dequantized
            k_r, v_r = k_s.transpose(0, 1)[None], v_s.transpose(0, 1)[None]  # [1, Hk, S, D]
            o = varying_shape_sdpa(q_r, k_r, v_r, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[start : start + n] = o[0].transpose(0, 1)  # [n, Hq, D]
        return out


class CpuTreeVerifyAttention(CpuRowsAttention, TreeVerifyAttention):
    """:class:`TreeVerifyAttention` as decode rows on the CPU (:class:`CpuRowsAttention`): node ``i``
    reads its request's ``kv_len`` cached slots, then the slots of its ancestors and itself. The
    reference plan is built only if a layer leaves the kernel."""

    def plan(self, reqs: Sequence[VerifyRequest]) -> None:
        table = self.req_to_token_pool.req_to_token
        self.mode = ForwardMode.TARGET_VERIFY
        self.out_slots = torch.cat([r.slots for r in reqs]).to(table.device)
        keys: list[torch.Tensor] = []
        for r in reqs:
            prefix, slots = table[r.req_pool_idx, : r.kv_len], r.slots.to(table.device)
            paths: list[list[int]] = []
            for i, parent in enumerate(r.tree.parents):
                paths.append((paths[parent] if parent >= 0 else []) + [i])
                keys.append(torch.cat([prefix, slots[paths[i]]]))
        lens = torch.tensor([k.numel() for k in keys], dtype=torch.int64)
        rows = torch.nn.utils.rnn.pad_sequence(keys, batch_first=True)  # [T, longest]
        self._reqs = list(reqs)
        self._tables = (self.out_slots, rows, torch.arange(len(keys)), lens)

    def _leave_rows(self) -> None:
        super().plan(self._reqs)  # TreeVerifyAttention's masked plan
        super()._leave_rows()


# ---------------------------------------------------------------------------------- acceptance
def target_probs(logits: torch.Tensor, s: SpecSampling) -> torch.Tensor:
    """The distribution the plain sampler draws from, ``[n, V]`` float32 (same filters, same order:
    temperature, then top-k/top-p, then min-p)."""
    x = logits.float() / s.temperature
    n = x.shape[0]
    if s.top_k > 0 or s.top_p < 1.0:
        top_ks = torch.full((n,), s.top_k, dtype=torch.int64, device=x.device)
        top_ps = torch.full((n,), s.top_p, dtype=torch.float32, device=x.device)
        x = x.masked_fill(top_k_top_p_drop_mask(x, top_ks, top_ps), float("-inf"))
    if s.min_p > 0.0:
        x = x.masked_fill(min_p_drop_mask(x, torch.full((n,), s.min_p, device=x.device)), float("-inf"))
    return torch.softmax(x, dim=-1)


def accept_greedy(tree: DraftTree, target_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """Longest path whose tokens equal the target's argmax, plus the bonus token.

    ``target_ids[u]``: argmax of the target at node ``u``. Returns ``(nodes, tokens)``: the path's
    nodes (root first) and the emitted tokens, ``len(nodes) == len(tokens)``.
    """
    children = tree.children()
    u, nodes, tokens = 0, [0], []
    while True:
        t = int(target_ids[u])
        tokens.append(t)
        nxt = next((c for c in children[u] if tree.tokens[c] == t), None)
        if nxt is None:
            return nodes, tokens
        nodes.append(nxt)
        u = nxt


def accept_sampling(
    tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], list[int]]:
    """Recursive speculative sampling over ``tree`` (module docstring); ``probs`` ``[n, V]`` are the
    target distributions per node. Returns ``(nodes, tokens)`` like :func:`accept_greedy`."""
    children = tree.children()
    u, nodes, tokens = 0, [0], []
    while True:
        p = probs[u].clone()
        q = tree.draft_probs[u] if tree.draft_probs is not None else None
        chosen = None
        for c in children[u]:
            x = tree.tokens[c]
            qx = float(q[x]) if q is not None else 1.0
            if qx <= 0.0:
                continue  # the drafter could not have drawn it: skip (keeps the rule exact)
            r = float(torch.rand((), generator=generator))
            if r < min(1.0, float(p[x]) / qx):
                chosen = c
                break
            p = (p - q).clamp_(min=0.0) if q is not None else p.index_fill_(0, torch.tensor([x]), 0.0)
            total = float(p.sum())
            p = p / total if total > 0 else probs[u].clone()
        if chosen is None:
            tokens.append(int(torch.multinomial(p, 1, generator=generator)))
            return nodes, tokens
        tokens.append(tree.tokens[chosen])
        nodes.append(chosen)
        u = chosen


# ---------------------------------------------------------------------------------- verifier
class TreeVerifier:
    """Runs verify passes for a :class:`~phloem.runtime.executor.model_runner.ModelRunner`.

    Reads ``runner.model`` (``model(ids, positions, attn) -> hidden``, ``compute_logits``),
    ``runner.kv_pool`` and ``runner.req_to_token_pool``; the tree attention is its own backend,
    so nothing in the runner changes.

    Parameters
    ----------
    runner:
        The target model runner.
    seed:
        Seed of the generator used by sampling acceptance.
    """

    def __init__(self, runner, *, seed: int = 0, graphs: Any = None) -> None:  # noqa: ANN001
        self.runner = runner
        self.attn = (CpuTreeVerifyAttention if decodes_in_rows(runner) else TreeVerifyAttention)(
            runner.kv_pool, runner.req_to_token_pool, num_heads=runner.model_config.num_heads
        )
        self.graphs = graphs  # VerifyGraphRunner on CUDA (padded trees, Triton, CUDA graphs), else None
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def reset_generator(self) -> None:
        """Restart the acceptance sampler's generator from ``seed`` (after the start-up warm-up)."""
        self.generator.manual_seed(self.seed)

    @torch.inference_mode()
    def verify(self, reqs: Sequence[VerifyRequest]) -> list[VerifyResult]:
        """Verify every request's tree in one target pass and commit the accepted nodes.

        Mutates ``req_to_token[row, kv_len : kv_len + accept_length]`` of each request and the KV
        pool at every node slot. The caller then advances ``kv_len`` by ``accept_length`` and
        frees ``free_slots``.
        """
        for r in reqs:
            if r.slots.numel() != len(r.tree):
                raise ValueError(
                    f"request row {r.req_pool_idx}: {len(r.tree)} nodes but {r.slots.numel()} slots"
                )
        logits, hidden, starts = self._forward(reqs)
        # one device sync for every plain greedy request's argmaxes
        plain = [r.sampling.greedy and r.bitmask is None for r in reqs]
        argmax = logits.argmax(dim=-1).tolist() if any(plain) else []
        paths = []
        for r, start, is_plain in zip(reqs, starts, plain):
            n = len(r.tree)
            ids = argmax[start : start + n] if is_plain else None
            paths.append(self._accept(r, logits[start : start + n], ids))
        return self._commit(reqs, starts, paths, hidden)

    def _forward(self, reqs: Sequence[VerifyRequest]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Logits and hidden states of every node, and the row where each request's nodes start."""
        if self.graphs is not None:
            logits, hidden = self.graphs.run(reqs)
            return logits, hidden, [b * self.graphs.nodes for b in range(len(reqs))]
        device = self.runner.device
        ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        for r in reqs:
            starts.append(len(ids))
            ids += r.tree.tokens
            positions += [r.kv_len + d for d in r.tree.depths]
        self.attn.plan(reqs)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        pos = torch.tensor(positions, dtype=torch.int64, device=device)
        hidden = self.runner.model(input_ids, pos, self.attn)  # [T, H]
        return self.runner.model.compute_logits(hidden), hidden, starts  # [T, V] float32

    def _accept(
        self, r: VerifyRequest, logits: torch.Tensor, argmax: list[int] | None
    ) -> tuple[list[int], list[int]]:
        if argmax is not None:
            nodes, tokens = accept_greedy(r.tree, argmax)
        else:
            if r.bitmask is not None:
                logits = apply_bitmask(logits, r.bitmask)  # in place on this request's rows
            if r.sampling.greedy:
                nodes, tokens = accept_greedy(r.tree, logits.argmax(dim=-1).tolist())
            else:
                probs = target_probs(logits, r.sampling).cpu()
                nodes, tokens = accept_sampling(r.tree, probs, self.generator)
        if r.max_accept is not None:
            keep = max(1, r.max_accept)
            nodes, tokens = nodes[:keep], tokens[:keep]
        return nodes, tokens

    def _commit(
        self,
        reqs: Sequence[VerifyRequest],
        starts: list[int],
        paths: list[tuple[list[int], list[int]]],
        hidden: torch.Tensor,
    ) -> list[VerifyResult]:
        """Move every accepted node into its request's row (one indexed write for the batch) and
        gather the accepted nodes' features (one gather); the indices travel in one pinned copy."""
        table = self.runner.req_to_token_pool.req_to_token
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        feature_rows: list[int] = []
        results: list[VerifyResult] = []
        for r, start, (nodes, tokens) in zip(reqs, starts, paths):
            slots = r.slots.tolist()
            rows += [r.req_pool_idx] * len(nodes)
            cols += range(r.kv_len, r.kv_len + len(nodes))
            vals += [slots[u] for u in nodes]
            feature_rows += [start + u for u in nodes]
            kept = set(nodes)
            free = torch.tensor([x for u, x in enumerate(slots) if u not in kept], dtype=r.slots.dtype)
            results.append(VerifyResult(tokens=tokens, nodes=nodes, free_slots=free, hidden=hidden[:0]))
        idx = to_device(torch.tensor([rows, cols, vals, feature_rows], dtype=torch.int64), table.device)
        table[idx[0], idx[1]] = idx[2]
        features = hidden[idx[3]]
        for res, h in zip(results, features.split([len(p[0]) for p in paths])):
            res.hidden = h
        return results
