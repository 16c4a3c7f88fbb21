"""N-gram proposer: drafts from the request's own context, no draft model (docs/design.md §7).

The longest suffix of the context (at most ``max_ngram`` tokens, at least ``min_ngram``) that
occurred earlier in the context is located at its most recent earlier occurrence; the tokens that
followed it there are the draft. Repetitive outputs (code, lists, quoted input) get long drafts;
text that never repeats gets none, and the step degrades to a plain decode step.
"""

from __future__ import annotations

from collections.abc import Sequence

from phloem.runtime.speculative.tree import DraftTree

__all__ = ["NgramProposer"]


class NgramProposer:
    """Longest-suffix-match drafts of up to ``num_draft`` tokens.

    Parameters
    ----------
    num_draft:
        Most draft tokens per proposal (the verified chain has ``num_draft + 1`` nodes).
    max_ngram, min_ngram:
        Suffix lengths tried, longest first.
    window:
        Only the last ``window`` context tokens are searched (bounds the cost on long contexts).
    """

    def __init__(
        self, num_draft: int = 4, *, max_ngram: int = 4, min_ngram: int = 1, window: int = 2048
    ) -> None:
        if num_draft < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("need num_draft >= 1 and 1 <= min_ngram <= max_ngram")
        self.num_draft, self.max_ngram, self.min_ngram, self.window = num_draft, max_ngram, min_ngram, window

    def propose(self, context: Sequence[int], num_draft: int | None = None) -> list[int]:
        """Draft tokens to follow ``context`` (possibly none).

        For suffix length ``m`` from ``max_ngram`` down to ``min_ngram``: find the latest start
        ``s < len(ctx) - m`` with ``ctx[s:s+m] == ctx[-m:]``; the draft is ``ctx[s+m : s+m+k]``,
        read from the context extended by the draft itself, so a periodic tail keeps repeating
        (``a b a b`` drafts ``a b a b ...``) instead of stopping at the end of the context.
        """
        k = self.num_draft if num_draft is None else num_draft
        ctx = list(context[-self.window :])
        n = len(ctx)
        for m in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            suffix = ctx[n - m :]
            for s in range(n - m - 1, -1, -1):  # latest earlier occurrence first
                if ctx[s : s + m] == suffix:
                    ext = ctx + []
                    for j in range(s + m, s + m + k):
                        ext.append(ext[j])
                    return ext[n:]
        return []

    def propose_tree(self, context: Sequence[int], num_draft: int | None = None) -> DraftTree:
        """A chain rooted at ``context[-1]`` (the request's newest token)."""
        return DraftTree.chain(context[-1], self.propose(context, num_draft))
