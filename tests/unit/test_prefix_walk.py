"""The divergence walk on hand-built radix trees: exact indices, the minimum, namespaces, no mutation."""

from __future__ import annotations

import torch
from phloem.runtime.cache.prefix_walk import MIN_MISSED_TOKENS, PrefixWalk, report_ids, report_text, walk
from phloem.runtime.cache.radix_tree import RadixTree
from phloem.runtime.scheduler.admission_report import prefix_report


def _tree(*keys: list[int], extra_key: str | None = None) -> RadixTree:
    tree = RadixTree()
    for key in keys:
        tree.insert(key, torch.arange(len(key), dtype=torch.int64), extra_key=extra_key)
    return tree


STEM = list(range(100, 140))  # a 40-token shared stem


def test_divergence_inside_a_node_names_the_first_differing_token() -> None:
    tree = _tree([1, 2, 3] + STEM)
    prompt = [1, 2, 9] + STEM
    result = walk(tree, prompt)
    assert result.matched == 2
    d = result.divergence
    assert d is not None
    assert d.token_index == 2
    assert d.cached_path_tokens == 43
    assert d.cached_after[:3] == (3, 100, 101)


def test_divergence_at_a_node_boundary_reports_the_deepest_child() -> None:
    short = [5, 6] + list(range(200, 220))  # 22 tokens
    long = [5, 6] + list(range(300, 350))  # 52 tokens
    tree = _tree(short, long)  # split after [5, 6]: two children
    result = walk(tree, [5, 6, 7, 8])
    assert result.matched == 2
    assert result.divergence is not None
    assert result.divergence.token_index == 2
    assert result.divergence.cached_path_tokens == 52
    assert result.divergence.cached_after[:2] == (300, 301)


def test_divergence_at_the_first_token_picks_among_the_root_children() -> None:
    tree = _tree([7] + STEM, [8] + STEM + [1, 2, 3])
    result = walk(tree, [9] + STEM)
    assert result.matched == 0
    assert result.divergence is not None
    assert (result.divergence.token_index, result.divergence.cached_path_tokens) == (0, 44)


def test_a_path_that_continues_less_than_the_minimum_is_not_reported() -> None:
    key = [1, 2, 3, 4] + list(range(10, 10 + MIN_MISSED_TOKENS - 1))
    tree = _tree(key)
    assert walk(tree, [1, 2, 3, 4, 99]).divergence is None  # misses 15 tokens
    tree = _tree(key + [42])
    d = walk(tree, [1, 2, 3, 4, 99]).divergence  # misses exactly 16
    assert d is not None and d.token_index == 4


def test_full_hits_and_prompts_running_past_a_path_miss_nothing() -> None:
    tree = _tree(STEM)
    assert walk(tree, STEM[:10]) == PrefixWalk(10, None)
    longer = walk(tree, STEM + [1, 2, 3])
    assert (longer.matched, longer.divergence) == (40, None)
    assert walk(None, STEM).divergence is None


def test_namespaces_do_not_mix() -> None:
    tree = _tree([1, 2] + STEM, extra_key="a")
    assert walk(tree, [1, 3] + STEM).divergence is None  # the default namespace is empty
    d = walk(tree, [1, 3] + STEM, extra_key="a").divergence
    assert d is not None and d.token_index == 1


def test_the_walk_changes_nothing() -> None:
    tree = _tree([1, 2, 3] + STEM)
    before = tree.pretty_print()
    walk(tree, [1, 2, 9])
    assert tree.pretty_print() == before  # match_prefix would have split the node


def test_report_windows_and_text() -> None:
    tree = _tree(list(range(1, 61)))
    prompt = list(range(1, 31)) + [0] + list(range(32, 61))
    raw = prefix_report(tree, prompt, extra_key=None)
    assert raw["cached_tokens"] == 30 and raw["prompt_tokens"] == 60
    d = raw["divergence"]
    assert d["token_index"] == 30 and d["cached_path_tokens"] == 60
    assert d["prompt_ids_before"] == list(range(7, 31))  # 24 tokens before
    assert d["prompt_ids_after"][:2] == [0, 32]
    assert d["cached_ids_after"][:2] == [31, 32]
    text = report_text(raw, lambda ids: ",".join(map(str, ids)))
    assert text["divergence"]["prompt_text_after"].startswith("0,32")
    assert text["divergence"]["cached_text_after"].startswith("31,32")
    assert set(text["divergence"]) == {
        "token_index", "cached_path_tokens", "prompt_text_before", "prompt_text_after", "cached_text_after",
        "shared_after",
    }  # fmt: skip
    # a request that ran reports what it reused, not the walk's figure
    assert report_ids(walk(tree, prompt), prompt, cached_tokens=7)["cached_tokens"] == 7
    # nothing to run: the last prompt token is always computed
    assert prefix_report(tree, list(range(1, 61)), extra_key=None)["cached_tokens"] == 59


def test_rejoin_counts_the_tokens_a_reorder_would_recover() -> None:
    tree = _tree([1, 2, 3] + STEM + [7, 7])
    # one token differs, then the stem follows again: 40 stem tokens rejoin the path
    assert walk(tree, [1, 2, 9] + STEM).divergence.shared_after == 40  # type: ignore[union-attr]
    # two tokens inserted before the stem: the rejoin is found further on
    assert walk(tree, [1, 2, 9, 9, 3] + STEM).divergence.shared_after == 41  # type: ignore[union-attr]
    # a different text after the divergence: reported (the path goes on), with nothing to recover
    other = list(range(500, 540))
    d = walk(tree, [1, 2, 9] + other).divergence
    assert d is not None and d.shared_after == 0


def test_an_unrelated_prompt_is_not_a_divergence_at_token_zero() -> None:
    tree = _tree(STEM)
    assert walk(tree, list(range(600, 650))).divergence is None
    d = walk(tree, [5] + STEM).divergence  # a user id ahead of the shared text: rejoins
    assert d is not None and (d.token_index, d.shared_after) == (0, 40)


def test_the_rejoined_path_wins_over_a_deeper_one() -> None:
    deep = [1] + list(range(700, 800))  # 101 tokens, nothing in common after the first
    near = [2] + STEM  # 41 tokens
    tree = _tree(deep, near)
    d = walk(tree, [3] + STEM).divergence
    assert d is not None and d.cached_path_tokens == 41 and d.shared_after == 40
