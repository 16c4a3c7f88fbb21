"""Incremental detokenization and stop-string handling for one request (docs/design.md §2, step ⑦).

Pure logic, no process: the detokenizer process keeps one :class:`RequestDecoder` per request and
pushes each batch of new token ids through it.

Offsets of :class:`IncrementalDecoder` over the request's token ids::

    ids:   ... | prefix_offset ........ read_offset ........ len(ids)
                 |<-- already returned -->|<-- new tokens -->|
    new text = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

Decoding a short window that starts a few tokens back (rather than each token alone) keeps
context-dependent decoding right (leading spaces, merges across tokens). A window whose text ends
in U+FFFD may end in half a UTF-8 character: the text before the trailing U+FFFD run is returned and
the rest is held until a later token completes the character (or :meth:`IncrementalDecoder.flush`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

REPLACEMENT = "\ufffd"
_TRIM_AT = 4096  # drop consumed ids from the head of the buffer past this many


class DecodingTokenizer(Protocol):
    """What the decoders need from a tokenizer (Hugging Face tokenizers and ours have it)."""

    def decode(
        self, ids: list[int], *, skip_special_tokens: bool = ..., spaces_between_special_tokens: bool = ...
    ) -> str: ...


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces that never change once returned.

    Parameters
    ----------
    tokenizer : DecodingTokenizer
        Anything with ``decode(ids, skip_special_tokens=..., spaces_between_special_tokens=...)``.
    skip_special_tokens, spaces_between_special_tokens : bool
        Passed to every ``decode`` call.
    prompt_ids : sequence of int, optional
        The prompt; its last ``context_tokens`` ids are decoded as context (never returned), which
        matters for tokenizers whose decode strips a leading space at the start of a text.
    context_tokens : int
        How many prompt tokens to use as context.

    Notes
    -----
    Without ``prompt_ids``, the concatenation of every :meth:`feed` result and :meth:`flush` equals
    ``tokenizer.decode(all_ids)`` for tokenizers whose decode is a concatenation of token bytes
    (byte-level BPE, byte-fallback SentencePiece).
    """

    def __init__(
        self,
        tokenizer: DecodingTokenizer,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        prompt_ids: Sequence[int] | None = None,
        context_tokens: int = 5,
    ) -> None:
        self._tokenizer = tokenizer
        self._kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self._ids: list[int] = list(prompt_ids[-context_tokens:]) if prompt_ids and context_tokens > 0 else []
        self._prefix = 0  # start of the decode window
        self._read = len(self._ids)  # end of the part whose text is fully returned
        self._base: str | None = None  # cached decode(ids[prefix:read])
        self._sent = 0  # characters past the base already returned (partial release)
        self.num_tokens = 0  # output tokens fed so far

    def feed(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids``; return the newly stable text (possibly empty)."""
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        self.num_tokens += len(new_ids)
        window = self._decode(self._ids[self._prefix :])
        start = len(self._base_text()) + self._sent
        if not window.endswith(REPLACEMENT):
            self._advance()
            return window[start:]
        stable = window.rstrip(REPLACEMENT)
        if len(stable) <= start:
            return ""
        self._sent += len(stable) - start
        return stable[start:]

    def flush(self) -> str:
        """Everything not yet returned, including a trailing incomplete character (as U+FFFD)."""
        if self._read == len(self._ids) and self._sent == 0:
            # The last feed returned everything: window and base would decode the same ids, so the
            # answer is "" without the two decodes (each as long as the whole output when a
            # non-streaming request finishes).
            self._advance()
            return ""
        window = self._decode(self._ids[self._prefix :])
        out = window[len(self._base_text()) + self._sent :]
        self._advance()
        return out

    def _advance(self) -> None:
        """Everything fed so far has been returned: move the window forward."""
        self._prefix, self._read = self._read, len(self._ids)
        self._base, self._sent = None, 0
        if self._prefix > _TRIM_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    def _base_text(self) -> str:
        if self._base is None:
            self._base = (
                self._decode(self._ids[self._prefix : self._read]) if self._read > self._prefix else ""
            )
        return self._base

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, **self._kwargs)


class StopStringHoldback:
    """Holds back streamed text that could be the start of a stop string.

    :meth:`push` returns the longest prefix of the text seen so far that contains no stop string
    and has no suffix that starts one; the rest waits. Once a whole stop string is seen nothing
    more is released until :meth:`finish`, which trims at the stop the request finished on.

    Parameters
    ----------
    stop_strs : sequence of str
        The request's stop strings (empty: everything passes straight through).
    """

    def __init__(self, stop_strs: Sequence[str]) -> None:
        self.stop_strs = tuple(s for s in stop_strs if s)
        self._longest = max((len(s) for s in self.stop_strs), default=0)
        self._held = ""
        self._blocked = False  # a whole stop string is in the held text

    @property
    def held(self) -> str:
        """Text received but not released yet."""
        return self._held

    def push(self, text: str) -> str:
        """Add newly decoded text; return the part that is safe to stream now."""
        if not self.stop_strs:
            return text
        self._held += text
        if self._blocked:
            return ""
        cut = self._first_stop()
        if cut is not None:
            self._blocked = True
        else:
            cut = self._partial_start()
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def finish(
        self, matched: str | int | None = None, *, no_stop_trim: bool = False, tail_chars: int | None = None
    ) -> str:
        """Release the held text at the end of the request, trimmed at ``matched`` (a stop string).

        ``tail_chars`` (from :class:`~phloem.runtime.sampling.stop.FinishReason`) locates the match
        exactly: it ends that many characters before the end of the text.
        """
        out = trim_at_stop(self._held, matched, no_stop_trim, tail_chars=tail_chars)
        self._held, self._blocked = "", False
        return out

    def _first_stop(self) -> int | None:
        """Start of the earliest whole stop string in the held text."""
        found = [i for i in (self._held.find(s) for s in self.stop_strs) if i >= 0]
        return min(found) if found else None

    def _partial_start(self) -> int:
        """Start of the longest held suffix that is a proper prefix of some stop string."""
        held = self._held
        for i in range(max(0, len(held) - self._longest + 1), len(held)):
            tail = held[i:]
            if any(s.startswith(tail) for s in self.stop_strs):
                return i
        return len(held)


def trim_at_stop(
    text: str, matched: str | int | None, no_stop_trim: bool, *, tail_chars: int | None = None
) -> str:
    """``text`` cut before the stop string ``matched`` (or after it when ``no_stop_trim``).

    Parameters
    ----------
    text : str
        The output text (or a suffix of it).
    matched : str, int or None
        The finish reason's ``matched``. Only strings trim text; a matched stop token is trimmed
        from the ids before decoding (see :func:`trim_stop_token`).
    no_stop_trim : bool
        Keep the stop string in the output.
    tail_chars : int, optional
        Characters of ``text`` after the end of the match. Without it the first occurrence of
        ``matched`` is used (SGLang's behaviour).
    """
    if not isinstance(matched, str) or not matched:
        return text
    start = -1
    if tail_chars is not None:
        end = len(text) - tail_chars
        if end - len(matched) >= 0 and text[end - len(matched) : end] == matched:
            start = end - len(matched)
    if start < 0:
        start = text.find(matched)
    if start < 0:
        return text
    return text[: start + len(matched)] if no_stop_trim else text[:start]


def trim_stop_token(ids: Sequence[int], matched: str | int | None, no_stop_trim: bool) -> list[int]:
    """``ids`` without a final matched stop token (EOS or a ``stop_token_ids`` entry)."""
    if isinstance(matched, int) and not no_stop_trim and ids and ids[-1] == matched:
        return list(ids[:-1])
    return list(ids)


class RequestDecoder:
    """Everything the detokenizer does for one request: decode, hold back stop prefixes, trim.

    Push each :class:`~phloem.runtime.messages.ReqTokenOut`'s ``new_ids`` with its ``finished``
    wire dict; the concatenation of the returned pieces is the request's final text.

    Parameters
    ----------
    tokenizer : DecodingTokenizer
        Used for decoding.
    skip_special_tokens, spaces_between_special_tokens : bool
        Decoding options of the request.
    stop_strs : sequence of str
        Stop strings (held back while streaming, trimmed at the end).
    no_stop_trim : bool
        Keep the matched stop string or stop token in the output.
    """

    def __init__(
        self,
        tokenizer: DecodingTokenizer,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop_strs: Sequence[str] = (),
        no_stop_trim: bool = False,
    ) -> None:
        self.decoder = IncrementalDecoder(
            tokenizer,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
        self.holdback = StopStringHoldback(stop_strs)
        self.no_stop_trim = no_stop_trim
        self.finished = False

    def push(self, new_ids: Sequence[int], finished: dict[str, Any] | None = None) -> str:
        """Feed new ids; with ``finished`` (a finish-reason wire dict) also flush everything."""
        if finished is None:
            return self.holdback.push(self.decoder.feed(new_ids))
        matched = finished.get("matched") if finished.get("type") == "stop" else None
        ids = trim_stop_token(new_ids, matched, self.no_stop_trim)
        text = self.decoder.feed(ids) + self.decoder.flush()
        self.finished = True
        tail = finished.get("tail_chars")
        return self.holdback.push(text) + self.holdback.finish(
            matched, no_stop_trim=self.no_stop_trim, tail_chars=tail if isinstance(tail, int) else None
        )
