"""Structural tags: the JSON format that constrains tagged regions (tool calls) of the output.

The spec text of a ``structural_tag`` grammar is JSON in one of two shapes:

- ``{"type": "structural_tag", "format": FORMAT}`` where ``FORMAT`` is a tree of
  ``const_string``, ``json_schema``, ``regex``, ``any_text``, ``sequence``, ``or``, ``tag``,
  ``tags_with_separator`` and ``triggered_tags`` nodes (xgrammar's structural-tag format);
- the older ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}``, which
  :func:`normalize_structural_tag` rewrites as a ``triggered_tags`` format.

:func:`structural_tag_to_lark` translates the common subset into a Lark grammar for llguidance.
"""

from __future__ import annotations

import json
from typing import Any

from .base import GrammarError

_ANY_TEXT = r"/(.|\n)*/"


def normalize_structural_tag(text: str) -> dict[str, Any]:
    """Parse a structural tag and return it in the ``{"type": "structural_tag", ...}`` shape.

    Raises
    ------
    GrammarError
        When the text is not JSON or has neither shape.
    """
    try:
        tag = json.loads(text)
    except ValueError as exc:
        raise GrammarError(f"structural tag is not valid JSON: {exc}") from exc
    if not isinstance(tag, dict):
        raise GrammarError("structural tag must be a JSON object")
    if tag.get("type") == "structural_tag" and isinstance(tag.get("format"), dict):
        return tag
    if isinstance(tag.get("structures"), list) and isinstance(tag.get("triggers"), list):
        return {"type": "structural_tag", "format": _legacy_to_format(tag)}
    raise GrammarError(
        'structural tag needs {"type": "structural_tag", "format": ...} or "structures"/"triggers"'
    )


def _legacy_to_format(tag: dict[str, Any]) -> dict[str, Any]:
    """Rewrite ``structures`` + ``triggers`` as one ``triggered_tags`` node."""
    tags = []
    for item in tag["structures"]:
        if not isinstance(item, dict) or not {"begin", "schema", "end"} <= item.keys():
            raise GrammarError('each structure needs "begin", "schema" and "end"')
        content = {"type": "json_schema", "json_schema": item["schema"]}
        tags.append({"type": "tag", "begin": item["begin"], "content": content, "end": item["end"]})
    return {"type": "triggered_tags", "triggers": list(tag["triggers"]), "tags": tags}


def structural_tag_to_lark(tag: dict[str, Any]) -> str:
    """Translate a normalized structural tag into a Lark grammar (llguidance dialect).

    Raises
    ------
    GrammarError
        For node types or options outside the supported subset.
    """
    fmt = tag["format"]
    if fmt.get("type") == "triggered_tags":
        return _triggered_tags_lark(fmt)
    return f"start: {_node(fmt)}\n"


def _node(fmt: Any) -> str:
    """The Lark expression of one format node (nested nodes inlined)."""
    if not isinstance(fmt, dict):
        raise GrammarError("structural tag format nodes must be JSON objects")
    kind = fmt.get("type")
    writer = _WRITERS.get(str(kind))
    if writer is None:
        raise GrammarError(f"structural tag node type {kind!r} is not supported by this backend")
    return writer(fmt)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else ""


def _const_string(fmt: dict[str, Any]) -> str:
    return _literal(fmt["value"]) or '""'


def _json_schema(fmt: dict[str, Any]) -> str:
    if fmt.get("style", "json") != "json":
        raise GrammarError(f"json_schema style {fmt['style']!r} is not supported by this backend")
    return "%json " + json.dumps(fmt["json_schema"])


def _regex(fmt: dict[str, Any]) -> str:
    return "/" + fmt["pattern"].replace("/", "\\/") + "/"


def _any_text(fmt: dict[str, Any]) -> str:
    if fmt.get("excludes") or fmt.get("max_tokens") or fmt.get("max_chars"):
        raise GrammarError("any_text with excludes or limits is not supported by this backend")
    return _ANY_TEXT


def _sequence(fmt: dict[str, Any]) -> str:
    return "(" + " ".join(_node(e) for e in fmt["elements"]) + ")"


def _or(fmt: dict[str, Any]) -> str:
    return "(" + " | ".join(_node(e) for e in fmt["elements"]) + ")"


def _tag(fmt: dict[str, Any]) -> str:
    begin, end = fmt["begin"], fmt["end"]
    if not isinstance(begin, str):
        raise GrammarError("token-valued tag begin is not supported by this backend")
    ends = end if isinstance(end, list) else [end]
    if not all(isinstance(e, str) for e in ends):
        raise GrammarError("token-valued tag end is not supported by this backend")
    end_expr = "(" + " | ".join(_literal(e) or '""' for e in ends) + ")"
    return f"({_literal(begin)} {_node(fmt['content'])} {end_expr})"


def _tags_with_separator(fmt: dict[str, Any]) -> str:
    one = "(" + " | ".join(_tag(t) for t in fmt["tags"]) + ")"
    body = one if fmt.get("stop_after_first") else f"{one} ({_literal(fmt['separator'])} {one})*"
    return body if fmt.get("at_least_one") else f"({body})?"


def _triggered_tags_lark(fmt: dict[str, Any]) -> str:
    """Free text with tags; a tag starts when its trigger appears (lazy text lexeme)."""
    if fmt.get("excludes"):
        raise GrammarError("triggered_tags with excludes is not supported by this backend")
    lines = [f"TEXT: {_ANY_TEXT}"]
    choices = []
    for i, tag in enumerate(fmt["tags"]):
        trigger = next((t for t in fmt["triggers"] if tag["begin"].startswith(t)), None)
        if trigger is None:
            raise GrammarError(f"tag begin {tag['begin']!r} starts with none of the triggers")
        rest = dict(tag, begin=tag["begin"][len(trigger) :])
        lines.append(f"tag{i}_trigger[lazy]: TEXT {_literal(trigger)}")
        lines.append(f"tag{i}: tag{i}_trigger {_tag(rest)}")
        choices.append(f"tag{i}")
    one = "(" + " | ".join(choices) + ")"
    if fmt.get("stop_after_first"):
        start = one if fmt.get("at_least_one") else f"{one} | TEXT"
    else:
        start = f"{one}+ TEXT" if fmt.get("at_least_one") else f"{one}* TEXT"
    return f"start: {start}\n" + "\n".join(lines) + "\n"


_WRITERS = {
    "const_string": _const_string,
    "json_schema": _json_schema,
    "regex": _regex,
    "any_text": _any_text,
    "sequence": _sequence,
    "or": _or,
    "tag": _tag,
    "tags_with_separator": _tags_with_separator,
}
