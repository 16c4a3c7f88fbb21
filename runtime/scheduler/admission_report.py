"""The prefix report of a prompt, as the scheduler builds it: at a request's first admission
(``return_prefix_report``) and for ``PrefixReportReq`` (``/debug/prefix``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phloem.runtime.cache.prefix_walk import report_ids, walk
from phloem.runtime.cache.radix_tree import RadixTree


def prefix_report(
    tree: RadixTree | None, ids: Sequence[int], *, extra_key: str | None, cached_tokens: int | None = None
) -> dict[str, Any]:
    """``prefix_walk.report_ids`` for ``ids``. ``cached_tokens``: what the request reused; when
    None (no request ran), what one would reuse: the walk's match, less the last prompt token,
    which is always computed."""
    result = walk(tree, ids, extra_key=extra_key)
    if cached_tokens is None:
        cached_tokens = min(result.matched, max(len(ids) - 1, 0))
    return report_ids(result, ids, cached_tokens=cached_tokens)
