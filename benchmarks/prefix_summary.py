"""Where a run's prompts stopped matching the prefix cache: the ``prefix_report`` of every request
(``phloem bench serving --prefix-report``), grouped by the text at the divergence.

Requests that diverge after the same text (``Time: 10:00:0`` before a changing digit) are one
group: one fix (move what changes after the shared part) recovers all of them. A group's
``tokens_lost`` sums the reports' ``shared_after``: the prompt tokens after the divergence that
follow the cached path again, which the request recomputed and a prompt with the differing part
moved after them would have reused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

KEY_CHARS = 40  # characters of text before the divergence that name a group


@dataclass
class DivergenceGroup:
    before: str  # the prompt text just before the divergence (the group's key)
    prompt_after: str  # one request's text from the divergence on
    cached_after: str  # the cached path's text from there
    count: int = 0
    tokens_lost: int = 0
    token_index_min: int = 0
    token_index_max: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tokens_lost(report: dict[str, Any]) -> int:
    d = report.get("divergence")
    return int(d.get("shared_after", 0)) if d else 0


def group_divergences(reports: Iterable[dict[str, Any] | None], top: int = 5) -> list[DivergenceGroup]:
    """The ``top`` groups with the most tokens lost (ties: more requests first)."""
    groups: dict[str, DivergenceGroup] = {}
    for report in reports:
        d = (report or {}).get("divergence")
        if not d:
            continue
        assert report is not None
        key = d["prompt_text_before"][-KEY_CHARS:]
        g = groups.get(key)
        if g is None:
            i = int(d["token_index"])
            g = groups[key] = DivergenceGroup(key, d["prompt_text_after"], d["cached_text_after"],
                                              token_index_min=i, token_index_max=i)  # fmt: skip
        g.count += 1
        g.tokens_lost += tokens_lost(report)
        g.token_index_min = min(g.token_index_min, int(d["token_index"]))
        g.token_index_max = max(g.token_index_max, int(d["token_index"]))
    return sorted(groups.values(), key=lambda g: (-g.tokens_lost, -g.count, g.before))[:top]


def format_divergences(groups: list[DivergenceGroup], requests: int) -> str:
    """The groups as text, for the end of the run's report."""
    if not groups:
        return f"Prefix divergences: none among {requests} requests"
    lines = [f"Prefix divergences (top {len(groups)}, {requests} requests):"]
    for n, g in enumerate(groups, 1):
        where = f"token {g.token_index_min}" + (
            f"-{g.token_index_max}" if g.token_index_max != g.token_index_min else ""
        )
        lines.append(f"  {n}. {g.count} requests, {g.tokens_lost} tokens lost, at {where}")
        lines.append(f"     before:  {_show(g.before)}")
        lines.append(f"     prompt:  {_show(g.prompt_after)}")
        lines.append(f"     cached:  {_show(g.cached_after)}")
    return "\n".join(lines)


def _show(text: str, limit: int = 60) -> str:
    text = text if len(text) <= limit else text[:limit] + "..."
    return repr(text)
