"""Parsed tool calls, their streamed pieces, and the JSON payload that carries them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; ``arguments`` is JSON text (as the OpenAI API carries it)."""

    index: int
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of call ``index``: ``name`` on its first delta, then argument text."""

    index: int
    name: str | None
    arguments: str


def merge_deltas(deltas: Sequence[ToolCallDelta]) -> list[ToolCall]:
    """Assemble streamed deltas into whole calls, in index order."""
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.name is not None:
            names[delta.index] = delta.name
        arguments.setdefault(delta.index, []).append(delta.arguments)
    return [ToolCall(i, names[i], "".join(arguments[i])) for i in sorted(names)]


def parse_call_payload(payload: str) -> list[tuple[str, str]] | None:
    """``(name, arguments JSON)`` pairs from a call payload: an object, a list, or ``;``-separated
    objects. None when the payload is not a well-formed call (then no call is taken from it)."""
    try:
        value = json.loads(payload)
    except ValueError:
        value = _semicolon_separated(payload)
    items = value if isinstance(value, list) else [value]
    calls = [_one_call(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _semicolon_separated(payload: str) -> list[Any] | None:
    try:
        return [json.loads(part) for part in payload.split(";") if part.strip()]
    except ValueError:
        return None


def _one_call(item: Any) -> tuple[str, str] | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return item["name"], json.dumps(arguments, ensure_ascii=False)
