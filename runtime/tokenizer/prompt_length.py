"""Encoding a long prompt that may not fit the context, without encoding all of it.

A prompt longer than the model's context is refused; encoding all of a multi-megabyte text only
to refuse it costs seconds of a tokenizer thread. :func:`encode_within` encodes growing prefixes
first (doubling from ``first_chars``) and stops as soon as a prefix alone has more tokens than
the limit. Otherwise it encodes the whole text once: the ids it returns are always those of the
whole text, never pieced together from prefixes.

A prefix is cut just before a space that follows a non-space character. Byte-level BPE
pre-tokenizers never join such a space to the character before it, so the prefix's tokens are
the first tokens of the whole text and its count is a floor of the whole text's. ``margin``
tokens are taken off that count all the same, for tokenizers whose pre-tokenizer could merge
across the cut. A text with no such space near a cut (one long word, text without spaces) is
encoded whole; the byte floor (``Tokenizer.token_floor``) already bounds how long that can be.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["CUT_WINDOW", "MARGIN", "PromptTooLong", "encode_within", "prefix_cut"]

MARGIN = 16  # tokens taken off a prefix's count: the cut may split what the whole text joins
CUT_WINDOW = 1024  # how far back from a prefix's end a cut is looked for


class PromptTooLong(Exception):
    """The text has at least ``at_least`` tokens, more than the limit it was encoded for."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"the text has at least {at_least} tokens")
        self.at_least = at_least


def prefix_cut(text: str, end: int, window: int = CUT_WINDOW) -> int | None:
    """The largest ``i <= end`` (and ``> end - window``) where ``text[i]`` is a space after a
    non-space character: ``text[:i]`` ends on a whole pre-token. None when there is none."""
    low = max(1, end - window + 1)
    i = text.rfind(" ", low, end + 1)
    while i >= low:
        if not text[i - 1].isspace():
            return i
        i = text.rfind(" ", low, i)
    return None


def encode_within(
    text: str, encode: Callable[[str], list[int]], limit: int, *, first_chars: int, margin: int = MARGIN
) -> list[int]:
    """``encode(text)``, unless a prefix of ``text`` shows it has more than ``limit`` tokens:
    then :class:`PromptTooLong`, without encoding the rest."""
    end = max(first_chars, 1)
    while end < len(text):
        cut = prefix_cut(text, end)
        if cut is not None:
            floor = len(encode(text[:cut])) - margin
            if floor > limit:
                raise PromptTooLong(floor)
        end *= 2
    return encode(text)
