"""Grammar masks over a draft tree, for constrained requests that speculate (docs/design.md §7).

Plain constrained decoding masks one row of logits with the grammar's state after every output
token. A verify pass scores a whole tree at once, so every node needs the mask of the state
*after its own path*: node ``u``'s logits predict the token that follows ``root .. u``, and the
root's token (the request's newest output) is already accepted by the matcher. One depth-first
walk fills them::

    at node u: mask[u] = matcher's next-token mask
    for each child c of u:
        if matcher.accept(tokens[c]): walk c; matcher.rollback(1)
        else: c and its subtree are ungrammatical (their rows stay "all allowed": no accepted
              path can reach them, because u's masked logits never choose tokens[c])

The walk leaves the matcher exactly as it found it. With the masks applied, greedy acceptance
picks the same tokens as plain masked greedy decoding, and sampling acceptance draws from the same
masked distribution; the scheduler then advances the matcher over the accepted tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from phloem.grammars.bitmask import allocate_bitmask
from phloem.runtime.speculative.tree import DraftTree

__all__ = ["tree_bitmask"]


def tree_bitmask(tree: DraftTree, matcher: Any, vocab_size: int) -> torch.Tensor:
    """Packed int32 mask ``[len(tree), ceil(V/32)]``: row ``u`` = tokens allowed after ``u``'s path.

    ``matcher`` is a :class:`~phloem.grammars.base.GrammarMatcher` in the request's current state
    (it has accepted the root's token). Mutates it only temporarily.
    """
    mask = allocate_bitmask(len(tree), vocab_size)  # every row starts "all allowed"
    children = tree.children()

    def walk(u: int) -> None:
        if matcher.is_terminated():
            return  # a stop token ended the path here: nothing can follow it
        matcher.fill_next_token_bitmask(mask, u)
        for c in children[u]:
            if matcher.accept_token(tree.tokens[c]):
                walk(c)
                matcher.rollback(1)

    walk(0)  # depth is the draft length (a handful of steps), so recursion stays shallow
    return mask
