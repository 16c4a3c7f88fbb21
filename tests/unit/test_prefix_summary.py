"""Grouping a run's prefix reports by the text at the divergence (``phloem bench serving --prefix-report``)."""

from __future__ import annotations

from phloem.bench.prefix_summary import format_divergences, group_divergences, tokens_lost


def _report(before: str, index: int, path: int, prompt: int = 100, after: str = "x") -> dict:
    """A report whose prompt rejoins the path for the rest of the shorter of the two."""
    return {
        "cached_tokens": index,
        "prompt_tokens": prompt,
        "divergence": {
            "token_index": index,
            "cached_path_tokens": path,
            "prompt_text_before": before,
            "prompt_text_after": after,
            "cached_text_after": "y",
            "shared_after": min(path, prompt) - index - 1,
        },
    }


def test_tokens_lost_is_what_rejoins_the_path() -> None:
    assert tokens_lost(_report("a", 10, 80, prompt=100)) == 69
    assert tokens_lost(_report("a", 10, 300, prompt=100)) == 89
    assert tokens_lost({"cached_tokens": 5, "prompt_tokens": 9, "divergence": None}) == 0


def test_groups_by_text_before_and_ranks_by_tokens_lost() -> None:
    reports = [
        _report("Time: 10:00:0", 5, 105, after="1 sys"),
        _report("Time: 10:00:0", 5, 105, after="2 sys"),
        _report("Time: 10:00:0", 5, 105, after="3 sys"),
        _report("user id 4", 3, 40),
        None,  # a request whose report was not returned
        {"cached_tokens": 99, "prompt_tokens": 100, "divergence": None},
    ]
    groups = group_divergences(reports)
    assert [(g.before, g.count, g.tokens_lost) for g in groups] == [
        ("Time: 10:00:0", 3, 282),
        ("user id 4", 1, 36),
    ]
    assert groups[0].prompt_after == "1 sys"  # the first request's text stands for the group
    assert len(group_divergences(reports, top=1)) == 1
    text = format_divergences(groups, requests=6)
    assert "3 requests, 282 tokens lost, at token 5" in text
    assert "'Time: 10:00:0'" in text


def test_group_key_is_the_tail_of_the_text_and_indices_span() -> None:
    long_a = "A" * 100 + "same tail of forty characters or so....."
    long_b = "B" * 100 + "same tail of forty characters or so....."
    groups = group_divergences([_report(long_a, 50, 200), _report(long_b, 60, 200)])
    assert len(groups) == 1
    assert (groups[0].token_index_min, groups[0].token_index_max, groups[0].count) == (50, 60, 2)
    assert "at token 50-60" in format_divergences(groups, 2)
    assert format_divergences([], 4) == "Prefix divergences: none among 4 requests"
