"""Streaming tool-call parsers: text deltas in, ``(text delta, call deltas)`` out.

One state machine per response. :meth:`StreamingToolParser.feed` settles what it can and holds the
rest (a possible start of a call marker, an open call, whitespace next to a call); :meth:`finish`
settles everything. The result does not depend on how the text was split, so a streamed response
reassembles to exactly the parse of the whole text.

What never reaches the text: call markup, whether the call parsed or not (an open call at the end,
a block whose payload is not a call), and the whitespace that separates calls from each other or
from the start and end of the response. Whitespace between two pieces of text is kept.
"""

from __future__ import annotations

import abc
import json
import re

from .calls import ToolCallDelta, parse_call_payload

PYTHON_TAG = "<|python_tag|>"
_CALL_LIKE = re.compile(r'\s*\{\s*"name"\s*:')


class StreamingToolParser(abc.ABC):
    """The shared bookkeeping; subclasses find the calls (``_step`` and ``_end``)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._next_index = 0
        self._text_out: list[str] = []
        self._calls_out: list[ToolCallDelta] = []
        self._pending_space = ""  # whitespace held until we know whether a call touches it
        self._near_call = False  # a call (or dropped markup) lies inside the held whitespace
        self._text_seen = False

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """Consume new text; returns the normal text and call pieces it settles."""
        self._buffer += delta
        while self._step(final=False):
            pass
        return self._flush()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of the response: settle everything still held."""
        while self._step(final=True):
            pass
        self._end()
        self._buffer = ""
        if not self._near_call:
            self._text_out.append(self._pending_space)
        self._pending_space = ""
        return self._flush()

    @abc.abstractmethod
    def _step(self, final: bool) -> bool:
        """Settle one piece of the buffer; False when the rest must wait (for more text or the end)."""

    @abc.abstractmethod
    def _end(self) -> None:
        """Settle what is left in the buffer at the end of the response."""

    def _text(self, text: str) -> None:
        """Normal text, in order; whitespace at its edges waits for what comes next."""
        body = text.strip()
        if not body:
            self._pending_space += text
            return
        lead = text[: len(text) - len(text.lstrip())]
        space = self._pending_space + lead
        keep = not self._near_call or self._text_seen
        self._text_out.append((space if keep else "") + text[len(lead) :].rstrip())
        self._pending_space = text[len(text.rstrip()) :]
        self._near_call = False
        self._text_seen = True

    def _block(self, payload: str | None) -> None:
        """A call region ended; its payload becomes calls when it is one, else it is dropped."""
        self._near_call = True
        calls = None if payload is None else parse_call_payload(payload)
        for name, arguments in calls or ():
            self._calls_out.append(ToolCallDelta(self._next_index, name, arguments))
            self._next_index += 1

    def _flush(self) -> tuple[str, list[ToolCallDelta]]:
        text, calls = "".join(self._text_out), self._calls_out
        self._text_out, self._calls_out = [], []
        return text, calls


class MarkedStreamingParser(StreamingToolParser):
    """Calls after a start marker: up to an end marker, or (``end`` None) one JSON value."""

    def __init__(self, start: str, end: str | None) -> None:
        super().__init__()
        self._start, self._end_marker = start, end
        self._in_call = False

    def _step(self, final: bool) -> bool:
        if not self._in_call:
            at = self._buffer.find(self._start)
            if at < 0:
                keep = 0 if final else _partial_suffix(self._buffer, self._start)
                self._text(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return False
            self._text(self._buffer[:at])
            self._buffer = self._buffer[at + len(self._start) :]
            self._in_call = True
            return True
        span = self._call_span()
        if span is None:
            return False
        payload_len, used = span
        payload, self._buffer = self._buffer[:payload_len], self._buffer[used:]
        self._in_call = False
        self._block(payload)
        return True

    def _call_span(self) -> tuple[int, int] | None:
        """(payload length, characters used) of the open call, or None while it is not closed."""
        if self._end_marker is not None:
            at = self._buffer.find(self._end_marker)
            return None if at < 0 else (at, at + len(self._end_marker))
        body = self._buffer.lstrip()
        if not body:
            return None
        skip = len(self._buffer) - len(body)
        if body[0] not in "[{":
            return (0, 0)  # not a payload: the marker alone is dropped
        try:
            _, size = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return None  # not closed yet (or never will be: the end settles it)
        return (skip + size, skip + size)

    def _end(self) -> None:
        if self._in_call:
            self._in_call = False
            self._block(self._buffer)
        else:
            self._text(self._buffer)


class BareJsonStreamingParser(StreamingToolParser):
    """A response that opens with ``{`` (or ``<|python_tag|>``) is held and parsed as calls at the end.

    Held text that does not parse stays text unless it starts like a call (``{"name":`` or the
    python tag): then it is a call cut short, and is dropped.
    """

    def __init__(self) -> None:
        super().__init__()
        self._mode = "undecided"  # then "text" or "json"

    def _step(self, final: bool) -> bool:
        if self._mode == "text":
            self._text(self._buffer)
            self._buffer = ""
            return False
        if self._mode == "json":
            return False
        head = self._buffer.lstrip()
        if not head:
            return False
        if head.startswith(("{", PYTHON_TAG)):
            self._mode = "json"
        elif final or not PYTHON_TAG.startswith(head):
            self._mode = "text"
            return True
        return False

    def _end(self) -> None:
        if self._mode != "json":
            self._text(self._buffer)
            return
        payload = self._buffer.strip()
        tagged = payload.startswith(PYTHON_TAG)
        payload = payload.removeprefix(PYTHON_TAG)
        if parse_call_payload(payload) is not None:
            self._block(payload)
        elif tagged or _CALL_LIKE.match(payload):
            self._block(None)
        else:
            self._text(self._buffer)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
