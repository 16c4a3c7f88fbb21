"""Does a constrained output obey its grammar, even when it was cut at ``max_new_tokens``?

Benchmarks that compare constrained with unconstrained decoding cut every reply at the same length,
so most constrained outputs are unfinished documents. A grammar still promises something about
them: the text is a prefix of a sentence of the grammar. That is what is checked here:

- regex: the text is a prefix of a full match (the ``regex`` module's partial matching);
- JSON schema: a finished document must validate against the schema; an unfinished array (the
  benchmarks' schemas are arrays of records) must start with ``[`` and every record completed before
  the cut must validate against the item schema (the record the cut falls in is not checked).
"""

from __future__ import annotations

import json
from typing import Any


def regex_prefix_ok(pattern: str, text: str, *, finished: bool) -> bool:
    """``text`` matches ``pattern`` in full (``finished``) or is a prefix of a match."""
    import regex

    return regex.fullmatch(pattern, text, partial=not finished) is not None


def json_prefix_ok(schema: dict[str, Any], text: str, *, finished: bool) -> bool:
    """``text`` validates against ``schema`` (``finished``), or is a valid start of an array of it."""
    import jsonschema

    try:
        document = json.loads(text)
    except ValueError:
        document = None
    if document is not None or finished:
        return document is not None and jsonschema.Draft202012Validator(schema).is_valid(document)
    body = text.lstrip()
    if schema.get("type") != "array" or not body.startswith("["):
        return False
    try:
        records = json.loads(body[: last_record_end(body) + 1] + "]")
    except ValueError:
        return False
    items = jsonschema.Draft202012Validator(schema.get("items", {}))
    return all(items.is_valid(r) for r in records)


def last_record_end(body: str) -> int:
    """Index of the ``}`` or ``]`` that closes the last complete element of the array ``body`` opens
    (0, the ``[``, when none is complete); string contents are skipped."""
    depth, in_string, escaped, end = 0, False, False, 0
    for i, c in enumerate(body):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 1:
                end = i
    return end


def output_ok(
    text: str, *, finished: bool, json_schema: dict[str, Any] | None = None, regex: str | None = None
) -> bool:
    """The check for whichever grammar constrained ``text`` (True when none did)."""
    if json_schema is not None:
        return json_prefix_ok(json_schema, text, finished=finished)
    if regex is not None:
        return regex_prefix_ok(regex, text, finished=finished)
    return True
