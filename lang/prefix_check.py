"""Prompt order checks for programs run with changing arguments.

A prefix cache reuses only the text calls share from their first character. A program that writes
an argument that changes from call to call (a timestamp, a user name) ahead of a long constant text
(the instructions, a document) makes every call recompute that text. :func:`late_stems` finds such
arguments in a traced program: each changing argument written before a generation and followed
by at least ``MIN_STEM_CHARS`` characters of constant text. :func:`shared_prefix_ratio` measures how
much of a batch's prompts the calls share.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from phloem.lang.tracer import _CLOSE, _OPEN, RequestTree

# About 50 tokens of English: shorter constant text after a changing argument costs little to recompute.
MIN_STEM_CHARS = 200

_PLACEHOLDER = re.compile(f"{_OPEN}([^{_OPEN}{_CLOSE}]*){_CLOSE}")
_PROMPT_ENDS = ("gen", "select", "fork", "read", "stop")  # steps after which text depends on the model


@dataclass(frozen=True)
class LateStem:
    """A changing argument written ahead of constant text the calls could otherwise share."""

    argument: str
    offset: int  # characters of prompt before the argument
    stem_chars: int  # constant characters after it, up to the next unknown value or generation


def varying_arguments(calls: Sequence[Mapping[str, Any]]) -> list[str]:
    """Names whose value is not the same in every call (absent from some calls counts as changing)."""
    names = sorted({name for call in calls for name in call})
    missing = object()
    varying = []
    for name in names:
        values = [call.get(name, missing) for call in calls]
        try:
            same = all(v == values[0] for v in values[1:])
        except Exception:  # a value that cannot be compared (arrays): treat it as changing
            same = False
        if not same:
            varying.append(name)
    return varying


def prompt_text(tree: RequestTree) -> str:
    """The text a traced program writes before its first generation, fork or variable read."""
    parts = []
    for step in tree.root.steps:
        if step.kind in _PROMPT_ENDS:
            break
        parts.append(step.text)
    return "".join(parts)


def late_stems(text: str, varying: Sequence[str], *, min_chars: int = MIN_STEM_CHARS) -> list[LateStem]:
    """Changing arguments (placeholders named in ``varying``) in ``text`` followed by at least
    ``min_chars`` constant characters before the next placeholder (any) or the end; first one first."""
    found: list[LateStem] = []
    marks = list(_PLACEHOLDER.finditer(text))
    for i, mark in enumerate(marks):
        name = mark.group(1)
        if name not in varying:
            continue
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        constant = end - mark.end()
        if constant >= min_chars and all(f.argument != name for f in found):
            found.append(LateStem(name, mark.start(), constant))
    return found


def warning_text(program: str, late: LateStem) -> str:
    return (
        f"program {program}: argument {late.argument!r} changes between calls and is written before "
        f"{late.stem_chars} characters of constant text, which no two calls can then share in the "
        f"prefix cache; write the constant text first and {late.argument!r} after it"
    )


def shared_prefix_ratio(texts: Sequence[str]) -> float:
    """The share of the texts' characters that a prefix cache could serve from an earlier text:
    ``1 - (characters of their prefix tree) / (all characters)``; 0.0 for fewer than two texts."""
    total = sum(len(t) for t in texts)
    if len(texts) < 2 or total == 0:
        return 0.0
    ordered = sorted(texts)
    # in sorted order, each text's longest common prefix with any other is with a neighbour
    shared = sum(len(os.path.commonprefix([a, b])) for a, b in zip(ordered, ordered[1:]))
    return shared / total
