"""Draft trees: the tokens one verify pass checks for one request (docs/design.md §7).

A tree of ``n`` nodes is two parallel lists::

    node:     0      1      2      3      4
    tokens:   t0     a      b      c      d        t0 = the request's last token (its KV is not
    parents:  -1     0      0      1      1             computed yet); a..d are draft tokens
    depth:    0      1      1      2      2

Parents always precede their children (``parents[i] < i``), so node 0 is the root and every
prefix of the node list is itself a tree. A chain is the tree with ``parents[i] == i - 1``.

Node ``i`` sits at sequence position ``kv_len + depth[i]`` and, in attention, sees the cached
prefix plus its ancestors and itself: row ``i`` of
:func:`~phloem.runtime.attention.base.ancestor_mask`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["DraftTree", "tree_depths"]


@dataclass
class DraftTree:
    """One request's draft tree (see module docstring).

    ``draft_probs`` (optional, float32 ``[n, V]``): row ``u`` is the distribution the children of
    node ``u`` were drawn from, independently, by the drafter. ``None`` means the children were
    chosen deterministically (top-k, n-gram), which the sampling rule treats as point masses.
    """

    tokens: list[int]
    parents: list[int]
    draft_probs: torch.Tensor | None = None
    _depths: list[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.parents):
            raise ValueError("a draft tree needs a root and one parent per node")
        if self.parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"parents must satisfy parents[0] == -1 and 0 <= parents[i] < i: {self.parents}")

    @classmethod
    def chain(cls, root: int, drafts: Sequence[int], draft_probs: torch.Tensor | None = None) -> DraftTree:
        """``root -> drafts[0] -> drafts[1] -> ...``."""
        return cls([root, *drafts], list(range(-1, len(drafts))), draft_probs)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        if self._depths is None:
            self._depths = tree_depths(self.parents)
        return self._depths

    def children(self) -> list[list[int]]:
        """``children()[u]``: the child nodes of ``u`` in node order."""
        out: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            out[p].append(i)
        return out


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (root 0); needs ``parents[i] < i``."""
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths
