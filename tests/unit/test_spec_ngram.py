"""N-gram proposer: longest suffix match, latest occurrence, periodic tails, limits."""

from __future__ import annotations

import pytest
from phloem.runtime.speculative.ngram import NgramProposer


@pytest.mark.parametrize(
    "context, k, max_ngram, expected",
    [
        ([1, 2, 3], 4, 4, []),  # nothing repeats
        ([1], 4, 4, []),  # too short to match anything
        ([1, 2, 3, 9, 1, 2], 2, 4, [3, 9]),  # suffix "1 2" seen before: what followed it
        ([1, 2, 3, 1, 2, 4, 1, 2], 1, 4, [4]),  # the latest earlier occurrence wins
        ([5, 1, 2, 3, 7, 2, 3, 1, 2, 3], 2, 4, [7, 2]),  # longest suffix first ("1 2 3" beats "2 3")
        ([7, 7], 4, 4, [7, 7, 7, 7]),  # a periodic tail keeps repeating past the context's end
        ([1, 2, 1, 2], 5, 4, [1, 2, 1, 2, 1]),
        ([4, 5, 6, 4, 5, 6, 4], 3, 1, [5, 6, 4]),  # max_ngram 1: only the last token is matched
    ],
)
def test_propose(context, k, max_ngram, expected):
    assert NgramProposer(k, max_ngram=max_ngram).propose(context) == expected


def test_min_ngram_and_window():
    p = NgramProposer(2, max_ngram=3, min_ngram=2)
    assert p.propose([1, 2, 9, 2]) == []  # only a 1-token suffix matches
    far = [1, 2, 3] + list(range(10, 60)) + [1, 2]
    assert NgramProposer(1, window=20).propose(far) == []  # the match lies outside the window
    assert NgramProposer(1).propose(far) == [3]


def test_tree_is_a_chain_rooted_at_the_newest_token():
    tree = NgramProposer(3).propose_tree([1, 2, 3, 1, 2])
    assert tree.tokens == [2, 3, 1, 2] and tree.parents == [-1, 0, 1, 2]


def test_bad_arguments():
    with pytest.raises(ValueError):
        NgramProposer(0)
    with pytest.raises(ValueError):
        NgramProposer(2, max_ngram=1, min_ngram=2)
