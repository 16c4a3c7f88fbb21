"""Where a prompt stops matching the prefix cache: a read-only walk of the radix tree.

A prompt that misses a long cached path by a few tokens (a timestamp or a user id written ahead
of a shared system prompt) recomputes everything after the first differing token. This walk
finds that token and the cached path the prompt would otherwise have followed, so a client can
see what to move.

"Closest cached path": walk the tree along the prompt; where the prompt leaves the tree, the
paths that continue from that point are the ones it missed. The one that goes deepest is
reported (ties go to the most recently used). It is reported only when it continues at least
``MIN_MISSED_TOKENS`` tokens past the divergence: a few tokens are not worth a warning, and a
prompt that merely runs past the end of a cached path (a longer question after a cached one)
missed nothing.

The walk reads ``children``, ``key``, ``depth`` and ``last_access`` of the nodes and changes
nothing (``RadixTree.match_prefix`` would split the node it ends in). It visits every node below
the divergence point to find the deepest path: O(nodes) in the worst case (a prompt that
diverges at its first token), which a diagnostic asked for per request can afford.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .radix_tree import Node, RadixTree

__all__ = [
    "CONTEXT_TOKENS",
    "MIN_MISSED_TOKENS",
    "Divergence",
    "PrefixWalk",
    "report_ids",
    "report_text",
    "walk",
]

MIN_MISSED_TOKENS = 16  # a cached path must go on this far past the divergence to be reported
CONTEXT_TOKENS = 24  # tokens of text shown on each side of the divergence


@dataclass(frozen=True)
class Divergence:
    """The first prompt token off the closest cached path, and that path."""

    token_index: int  # first prompt token that no cached path continues with
    cached_path_tokens: int  # length of the closest cached path, from the root
    cached_after: tuple[int, ...]  # the path's tokens from ``token_index`` (at most CONTEXT_TOKENS)


@dataclass(frozen=True)
class PrefixWalk:
    matched: int  # leading prompt tokens on some cached path (any tier)
    divergence: Divergence | None


def walk(
    tree: RadixTree | None,
    ids: Sequence[int],
    *,
    extra_key: str | None = None,
    min_missed: int = MIN_MISSED_TOKENS,
    context: int = CONTEXT_TOKENS,
) -> PrefixWalk:
    """Follow ``ids`` down ``tree`` (in the ``extra_key`` namespace) without changing it."""
    if tree is None or not ids:
        return PrefixWalk(0, None)
    root = tree.root
    node, pos = root, 0
    while pos < len(ids):
        # the tree's edge rule: the root's children are keyed by (extra_key, token), deeper ones by token
        child = node.children.get((extra_key, ids[pos]) if node is root else ids[pos])
        if child is None:
            candidates = [c for c in node.children.values() if node is not root or c.extra_key == extra_key]
            return PrefixWalk(pos, _missed(tree, candidates, pos, min_missed, context))
        n = _common_len(child.key, ids, pos)
        if n < len(child.key):
            # diverges inside ``child`` (or the prompt ends there: nothing missed)
            if pos + n == len(ids):
                return PrefixWalk(len(ids), None)
            return PrefixWalk(pos + n, _missed(tree, [child], pos + n, min_missed, context))
        node, pos = child, pos + n
    return PrefixWalk(pos, None)


def _missed(
    tree: RadixTree, candidates: list[Node], at: int, min_missed: int, context: int
) -> Divergence | None:
    best: Node | None = None
    for start in candidates:
        leaf = _deepest(start)
        if best is None or (leaf.depth, leaf.last_access) > (best.depth, best.last_access):
            best = leaf
    if best is None or best.depth - at < min_missed:
        return None
    tokens: list[int] = []
    for n in tree.path_to(best):
        tokens.extend(n.key)
        if len(tokens) >= at + context:
            break
    return Divergence(at, best.depth, tuple(tokens[at : at + context]))


def _deepest(start: Node) -> Node:
    best, stack = start, [start]
    while stack:
        n = stack.pop()
        if (n.depth, n.last_access) > (best.depth, best.last_access):
            best = n
        stack.extend(n.children.values())
    return best


def _common_len(node_key: tuple[int, ...], ids: Sequence[int], pos: int) -> int:
    i, n = 0, min(len(node_key), len(ids) - pos)
    while i < n and node_key[i] == ids[pos + i]:
        i += 1
    return i


def report_ids(
    result: PrefixWalk, ids: Sequence[int], *, cached_tokens: int, context: int = CONTEXT_TOKENS
) -> dict[str, Any]:
    """The report as token ids (what the scheduler sends; :func:`report_text` decodes it)."""
    d = result.divergence
    div = None
    if d is not None:
        i = d.token_index
        div = {
            "token_index": i,
            "cached_path_tokens": d.cached_path_tokens,
            "prompt_ids_before": list(ids[max(i - context, 0) : i]),
            "prompt_ids_after": list(ids[i : i + context]),
            "cached_ids_after": list(d.cached_after),
        }
    return {"cached_tokens": cached_tokens, "prompt_tokens": len(ids), "divergence": div}


def report_text(raw: dict[str, Any], decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """``meta_info.prefix_report``: :func:`report_ids` with the token windows decoded to text."""
    d = raw.get("divergence")
    div = None
    if d is not None:
        div = {
            "token_index": d["token_index"],
            "cached_path_tokens": d["cached_path_tokens"],
            "prompt_text_before": decode(d["prompt_ids_before"]),
            "prompt_text_after": decode(d["prompt_ids_after"]),
            "cached_text_after": decode(d["cached_ids_after"]),
        }
    return {"cached_tokens": raw["cached_tokens"], "prompt_tokens": raw["prompt_tokens"], "divergence": div}
