"""Where a prompt stops matching the prefix cache: a read-only walk of the radix tree.

A prompt that misses a long cached path by a few tokens (a timestamp or a user id written ahead
of a shared system prompt) recomputes everything after the first differing token. This walk
finds that token and the cached path the prompt would otherwise have followed, so a client can
see what to move.

"Closest cached path": walk the tree along the prompt; where the prompt leaves the tree, the
paths that continue from that point are the ones it missed. Each candidate (the node the prompt
left, or each child of the node it stopped at; at most ``MAX_CANDIDATES``, most recently used
first) stands for its deepest path. The reported path is the one the prompt *rejoins* most: within
``MAX_SHIFT`` tokens after the divergence the prompt's tokens line up with the path's again for at
least ``MIN_MISSED_TOKENS`` tokens in a row (``shared_after`` counts how many; the timestamp's
digits were the only difference). Without a rejoin, the deepest path is reported.

A divergence is reported only when the path continues at least ``MIN_MISSED_TOKENS`` (16) tokens
past it: a few tokens are not worth a warning, and a prompt that merely runs past the end of a
cached path missed nothing. A divergence at the prompt's first token is reported only with a
rejoin: an unrelated prompt shares nothing with the cache and missed nothing either.

The walk reads ``children``, ``key``, ``depth`` and ``last_access`` of the nodes and changes
nothing (``RadixTree.match_prefix`` would split the node it ends in). Finding the deepest path
visits the nodes below the divergence: O(nodes) in the worst case, which a diagnostic asked for
per request can afford.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the tokenizer manager imports this module for report_text: keep torch out
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
MAX_SHIFT = 64  # how far after the divergence a rejoin of the cached path is looked for
MAX_CANDIDATES = 32  # cached paths compared at one divergence point


@dataclass(frozen=True)
class Divergence:
    """The first prompt token off the closest cached path, and that path."""

    token_index: int  # first prompt token that no cached path continues with
    cached_path_tokens: int  # length of the closest cached path, from the root
    cached_after: tuple[int, ...]  # the path's tokens from ``token_index`` (at most CONTEXT_TOKENS)
    shared_after: int = 0  # prompt tokens after the divergence that rejoin the path (0: no rejoin)


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
            return PrefixWalk(pos, _missed(tree, candidates, ids, pos, min_missed, context))
        n = _common_len(child.key, ids, pos)
        if n < len(child.key):
            # diverges inside ``child`` (or the prompt ends there: nothing missed)
            if pos + n == len(ids):
                return PrefixWalk(len(ids), None)
            return PrefixWalk(pos + n, _missed(tree, [child], ids, pos + n, min_missed, context))
        node, pos = child, pos + n
    return PrefixWalk(pos, None)


def _missed(
    tree: RadixTree, candidates: list[Node], ids: Sequence[int], at: int, min_missed: int, context: int
) -> Divergence | None:
    ranked = sorted(candidates, key=lambda n: n.last_access, reverse=True)[:MAX_CANDIDATES]
    best: tuple[int, int, int] | None = None  # (shared_after, depth, last_access)
    chosen: tuple[Node, list[int], int] | None = None
    for start in ranked:
        leaf = _deepest(start)
        path = [t for n in tree.path_to(leaf) for t in n.key]
        shared = _rejoin(path, ids, at, min_missed)
        rank = (shared, leaf.depth, leaf.last_access)
        if best is None or rank > best:
            best, chosen = rank, (leaf, path, shared)
    if chosen is None:
        return None
    leaf, path, shared = chosen
    if leaf.depth - at < min_missed or (at == 0 and shared == 0):
        return None
    return Divergence(at, leaf.depth, tuple(path[at : at + context]), shared)


def _rejoin(path: list[int], ids: Sequence[int], at: int, run: int) -> int:
    """Tokens of ``ids`` after ``at`` that follow ``path`` again: the longest stretch starting
    that starts within ``MAX_SHIFT`` tokens after ``at`` in both (so tokens inserted or removed
    before it are allowed) and is at least ``run`` tokens long; 0 when there is none."""
    grams: dict[tuple[int, ...], int] = {}
    for c in range(at, min(at + MAX_SHIFT, len(path) - run + 1)):
        grams.setdefault(tuple(path[c : c + run]), c)
    best = 0
    p = at
    while p < min(at + MAX_SHIFT, len(ids) - run + 1):
        found = grams.get(tuple(ids[p : p + run]))
        if found is None:
            p += 1
            continue
        c, n = found, run
        while p + n < len(ids) and c + n < len(path) and ids[p + n] == path[c + n]:
            n += 1
        best = max(best, n)
        p += n
    return best


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
            "shared_after": d.shared_after,
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
            "shared_after": d.get("shared_after", 0),
        }
    return {"cached_tokens": raw["cached_tokens"], "prompt_tokens": raw["prompt_tokens"], "divergence": div}
