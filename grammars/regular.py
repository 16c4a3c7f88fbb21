"""Which grammars may run as token automata on the device (:mod:`phloem.grammars.automaton`).

A regex always may. A JSON schema may when its language is regular and the outlines-core
schema-to-regex conversion honours every keyword in it: a keyword it would ignore (numeric
bounds, ``oneOf``'s exclusivity, formats it spells loosely) would let through output the schema
rejects, and a recursive ``$ref`` would be cut at a fixed depth. Such a schema keeps the host
path of the server's grammar backend, which checks it fully.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import GrammarKind, GrammarSpec

# Keywords whose meaning the schema-to-regex conversion keeps exactly.
_HONOURED = frozenset({
    "type", "properties", "required", "items", "enum", "const", "anyOf",
    "minLength", "maxLength", "pattern", "minItems", "maxItems",
    "$defs", "definitions", "$ref",
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
})  # fmt: skip
_FORMATS = frozenset({"date-time", "date", "time", "uuid"})
_REF = re.compile(r"^#/(\$defs|definitions)/([^/]+)$")


def runs_on_device(spec: GrammarSpec) -> bool:
    """Whether ``spec`` may be compiled into a device token automaton."""
    if spec.kind is GrammarKind.REGEX:
        return True
    if spec.kind is not GrammarKind.JSON_SCHEMA:
        return False
    try:
        schema = json.loads(spec.text)
    except ValueError:
        return False
    return isinstance(schema, dict) and _honoured(schema) and not _recursive(schema)


def _honoured(schema: dict[str, Any]) -> bool:
    """Every keyword anywhere in the schema is one the conversion keeps (iterative walk)."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(x for x in node if isinstance(x, (dict, list)))
            continue
        if not isinstance(node, dict):
            return False
        for key, value in node.items():
            if key == "format":
                if value not in _FORMATS:
                    return False
            elif key == "additionalProperties":
                if value is not False:
                    return False
            elif key not in _HONOURED:
                return False
            elif key in ("properties", "$defs", "definitions"):
                if not isinstance(value, dict):
                    return False
                stack.extend(value.values())
            elif key == "items":
                if not isinstance(value, dict):
                    return False
                stack.append(value)
            elif key == "anyOf":
                stack.append(value)
    return True


def _recursive(schema: dict[str, Any]) -> bool:
    """Whether a ``$ref`` can reach itself (a reference to the root or outside ``$defs`` counts)."""
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    edges = {name: _refs(body) for name, body in defs.items()}
    root_refs = _refs({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
    if None in root_refs or any(None in refs for refs in edges.values()):
        return True
    state: dict[str, int] = {}  # 1 on the path, 2 done
    for start in edges:
        if state.get(start):
            continue
        path = [(start, iter(edges[start]))]
        state[start] = 1
        while path:
            node, it = path[-1]
            nxt = next(it, "")
            if not nxt:
                state[node] = 2
                path.pop()
            elif state.get(nxt) == 1:
                return True
            elif not state.get(nxt) and nxt in edges:
                state[nxt] = 1
                path.append((nxt, iter(edges[nxt])))
    return False


def _refs(node: Any) -> set[str | None]:
    """Names of the definitions ``node`` refers to; None for a reference of any other form."""
    found: set[str | None] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            for key, value in item.items():
                if key == "$ref":
                    match = _REF.match(value) if isinstance(value, str) else None
                    found.add(match.group(2) if match else None)
                else:
                    stack.append(value)
    return found


# ASCII meanings of the shorthand classes, as xgrammar and JSON Schema (ECMA-262) read them;
# outlines-core's regex engine would otherwise take \d as any Unicode decimal digit.
_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v"}


def ascii_shorthands(pattern: str) -> str:
    """``pattern`` with ``\\d``, ``\\w`` and ``\\s`` spelled as their ASCII classes (``\\D``, ``\\W``,
    ``\\S`` as the complements), inside and outside brackets; every other escape is kept."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            spelled = _ASCII_CLASSES.get(nxt.lower())
            if spelled is None:
                out.append(pattern[i : i + 2])
            elif in_class and nxt.islower():
                out.append(spelled)
            elif nxt.islower():
                out.append(f"[{spelled}]")
            elif not in_class:
                out.append(f"[^{spelled}]")
            else:  # a negated shorthand inside brackets has no bracket spelling: keep it
                out.append(pattern[i : i + 2])
            i += 2
            continue
        if ch == "[" and not in_class:
            in_class = True
            out.append(ch)
            if pattern[i + 1 : i + 2] == "^":
                out.append("^")
                i += 1
            if pattern[i + 1 : i + 2] == "]":  # a literal ] first in the class
                out.append("]")
                i += 1
        elif ch == "]" and in_class:
            in_class = False
            out.append(ch)
        else:
            out.append(ch)
        i += 1
    return "".join(out)

