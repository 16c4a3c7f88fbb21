"""Tool-call formats per model family: the structural tag that forces a call, and the parsers.

Families:

- ``qwen``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks (Qwen2/2.5/3,
  Hermes-style templates).
- ``smollm2``: ``<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`` (a list or one object
  inside the tags, as in SmolLM2's tool-use prompt; the GGUF's own chat template has no tool
  section, so the prompt side is left to the chat-template layer).
- ``llama3``: a bare JSON object ``{"name": ..., "parameters": {...}}`` (several separated by ``;``).

Parsing is one state machine, :class:`StreamingToolParser`; :meth:`ToolCallFormat.parse` runs it
over the whole text, so streamed and non-streamed results agree for any chunking. Text outside
calls is returned unchanged (not stripped). A block whose JSON does not parse stays normal text.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..base import GrammarKind, GrammarSpec


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


class ToolCallFormat(abc.ABC):
    """How one model family writes tool calls."""

    name: ClassVar[str]
    separator: ClassVar[str] = "\n"

    @abc.abstractmethod
    def call_tag(self, name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
        """The structural-tag ``tag`` node for one call of function ``name``."""

    @abc.abstractmethod
    def streaming_parser(self) -> StreamingToolParser:
        """A fresh streaming parser for one response."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Split a full response into normal text and tool calls."""
        parser = self.streaming_parser()
        pieces = [parser.feed(text), parser.finish()]
        normal = "".join(p[0] for p in pieces)
        return normal, merge_deltas([d for p in pieces for d in p[1]])

    def structural_tag(
        self, tools: Sequence[Mapping[str, Any]], tool_choice: Any, *, parallel: bool = True
    ) -> dict[str, Any] | None:
        """The structural tag forcing a call when ``tool_choice`` demands one, else None.

        With ``parallel`` false, ``"required"`` allows exactly one call.
        """
        functions = {f["name"]: f.get("parameters") or {"type": "object"} for f in map(_function, tools)}
        if tool_choice in (None, "auto", "none") or not functions:
            if tool_choice == "required":
                raise ValueError('tool_choice "required" needs at least one tool')
            return None
        if tool_choice == "required":
            tags = [self.call_tag(n, p) for n, p in functions.items()]
            fmt = {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": self.separator,
                "at_least_one": True,
                "stop_after_first": not parallel,
            }
            return {"type": "structural_tag", "format": fmt}
        name = _chosen_name(tool_choice)
        if name not in functions:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        return {"type": "structural_tag", "format": self.call_tag(name, functions[name])}


class TaggedToolCallFormat(ToolCallFormat):
    """Calls as JSON inside ``<tool_call>`` ... ``</tool_call>``."""

    start_marker: ClassVar[str] = "<tool_call>"
    end_marker: ClassVar[str] = "</tool_call>"
    begin: ClassVar[str]
    end: ClassVar[str]

    def call_tag(self, name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
        begin = f'{self.begin}{{"name": {json.dumps(name)}, "arguments": '
        content = {"type": "json_schema", "json_schema": dict(parameters)}
        return {"type": "tag", "begin": begin, "content": content, "end": "}" + self.end}

    def streaming_parser(self) -> StreamingToolParser:
        return TaggedStreamingParser(self.start_marker, self.end_marker)


class QwenToolCallFormat(TaggedToolCallFormat):
    name = "qwen"
    begin = "<tool_call>\n"
    end = "\n</tool_call>"


class SmolLM2ToolCallFormat(TaggedToolCallFormat):
    name = "smollm2"
    begin = "<tool_call>"
    end = "</tool_call>"


class Llama3ToolCallFormat(ToolCallFormat):
    """A response that starts with ``{`` is a call (or several separated by ``;``)."""

    name = "llama3"
    separator = "; "

    def call_tag(self, name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
        begin = f'{{"name": {json.dumps(name)}, "parameters": '
        content = {"type": "json_schema", "json_schema": dict(parameters)}
        return {"type": "tag", "begin": begin, "content": content, "end": "}"}

    def streaming_parser(self) -> StreamingToolParser:
        return BareJsonStreamingParser()


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    fmt.name: fmt for fmt in (QwenToolCallFormat(), SmolLM2ToolCallFormat(), Llama3ToolCallFormat())
}


def get_tool_call_format(name: str) -> ToolCallFormat:
    """The format registered as ``name`` (``qwen``, ``smollm2``, ``llama3``)."""
    if name not in TOOL_CALL_FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; choose one of {', '.join(TOOL_CALL_FORMATS)}")
    return TOOL_CALL_FORMATS[name]


def structural_tag_for(
    tools: Sequence[Mapping[str, Any]], tool_choice: Any, *, format: str = "qwen", parallel: bool = True
) -> GrammarSpec | None:
    """The grammar forcing a tool call, or None when ``tool_choice`` does not require one.

    Parameters
    ----------
    tools : Sequence[Mapping]
        OpenAI tools (``{"type": "function", "function": {"name", "parameters"}}``) or bare
        ``{"name", "parameters"}`` functions.
    tool_choice : str | Mapping | None
        ``"auto"``/``"none"``/None (no constraint), ``"required"`` (one or more calls, nothing
        else), or ``{"type": "function", "function": {"name": ...}}`` (exactly that call).
    format : str
        Tool-call format name.
    parallel : bool
        OpenAI's ``parallel_tool_calls``: when false, ``"required"`` allows exactly one call.
    """
    tag = get_tool_call_format(format).structural_tag(tools, tool_choice, parallel=parallel)
    if tag is None:
        return None
    return GrammarSpec(GrammarKind.STRUCTURAL_TAG, json.dumps(tag, sort_keys=True))


def parse_tool_calls(text: str, *, format: str = "qwen") -> tuple[str, list[ToolCall]]:
    """Split a full response into normal text and tool calls (see :class:`ToolCallFormat`)."""
    return get_tool_call_format(format).parse(text)


def merge_deltas(deltas: Sequence[ToolCallDelta]) -> list[ToolCall]:
    """Assemble streamed deltas into whole calls, in index order."""
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.name is not None:
            names[delta.index] = delta.name
        arguments.setdefault(delta.index, []).append(delta.arguments)
    return [ToolCall(i, names[i], "".join(arguments[i])) for i in sorted(names)]


class StreamingToolParser(abc.ABC):
    """Turns streamed text into ``(text_delta, call_deltas)`` pairs.

    Text that might still become part of a call is held back until it is decided; :meth:`finish`
    releases everything held.
    """

    def __init__(self) -> None:
        self._next_index = 0

    @abc.abstractmethod
    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """Consume new text; returns the normal text and call pieces it settles."""

    @abc.abstractmethod
    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of the response: settle everything still held."""

    def _calls(self, payload: str) -> list[ToolCallDelta] | None:
        """Deltas for the call(s) in a JSON payload, or None when it is not a call."""
        calls = parse_call_payload(payload)
        if calls is None:
            return None
        deltas = []
        for name, arguments in calls:
            deltas.append(ToolCallDelta(self._next_index, name, arguments))
            self._next_index += 1
        return deltas


class TaggedStreamingParser(StreamingToolParser):
    """State machine over ``start`` ... ``end`` blocks."""

    def __init__(self, start: str, end: str) -> None:
        super().__init__()
        self._start, self._end = start, end
        self._buffer = ""
        self._in_call = False

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self._buffer += delta
        text: list[str] = []
        calls: list[ToolCallDelta] = []
        while self._step(text, calls):
            pass
        return "".join(text), calls

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        text, calls = self.feed("")
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            parsed = self._calls(rest)
            if parsed is not None:
                return text, calls + parsed
            rest = self._start + rest
        return text + rest, calls

    def _step(self, text: list[str], calls: list[ToolCallDelta]) -> bool:
        """Settle one piece of the buffer; False when the rest must wait for more text."""
        if not self._in_call:
            at = self._buffer.find(self._start)
            if at < 0:
                keep = _partial_suffix(self._buffer, self._start)
                text.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return False
            text.append(self._buffer[:at])
            self._buffer = self._buffer[at + len(self._start) :]
            self._in_call = True
            return True
        at = self._buffer.find(self._end)
        if at < 0:
            return False
        payload = self._buffer[:at]
        self._buffer = self._buffer[at + len(self._end) :]
        self._in_call = False
        parsed = self._calls(payload)
        if parsed is None:
            text.append(self._start + payload + self._end)
        else:
            calls.extend(parsed)
        return True


class BareJsonStreamingParser(StreamingToolParser):
    """A response whose first non-space character is ``{`` is held and parsed as calls at the end."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._mode = "undecided"  # then "text" or "json"

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if self._mode == "text":
            return delta, []
        self._buffer += delta
        stripped = self._buffer.lstrip()
        if self._mode == "undecided" and stripped:
            self._mode = "json" if stripped.startswith("{") else "text"
        if self._mode == "text":
            text, self._buffer = self._buffer, ""
            return text, []
        return "", []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        held, self._buffer = self._buffer, ""
        if self._mode == "json":
            parsed = self._calls(held)
            if parsed is not None:
                return held[: len(held) - len(held.lstrip())], parsed
        return held, []


def parse_call_payload(payload: str) -> list[tuple[str, str]] | None:
    """``(name, arguments JSON)`` pairs from a call payload: an object, a list, or ``;``-separated."""
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
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return item["name"], json.dumps(arguments, ensure_ascii=False)


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function description inside an OpenAI tool (or the tool itself when bare)."""
    function = tool.get("function", tool)
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError("each tool needs a function with a string name")
    return function


def _chosen_name(tool_choice: Any) -> str:
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function", tool_choice)
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return function["name"]
    raise ValueError(
        f'tool_choice must be "auto", "none", "required" or name a function, got {tool_choice!r}'
    )


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
