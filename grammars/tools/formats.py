"""Tool-call formats per model family: how calls are written, forced, parsed and described.

Families (the name is what ``tool_call_format`` / ``tool_call_parser`` take):

- ``qwen``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, one per call
  (Qwen2/2.5/3 and Hermes-style templates).
- ``smollm2``: one ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`` block holding
  a list of calls (SmolLM2's tool-use prompt; a single object inside the tags is read too).
- ``llama3``: a response that is a bare JSON object ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``; several separated by ``;``), as Llama 3.1+ templates ask.
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}`` objects.

Each format gives the structural tag that forces a call (the grammar path compiles it), a streaming
parser (:mod:`.streaming`), the text that renders calls (for chat histories whose template has no
tool support) and a system prompt describing the tools in that format.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from ..base import GrammarKind, GrammarSpec
from .calls import ToolCall, merge_deltas
from .streaming import BareJsonStreamingParser, MarkedStreamingParser, StreamingToolParser

Call = tuple[str, Mapping[str, Any]]


class ToolCallFormat(abc.ABC):
    """How one model family writes tool calls."""

    name: ClassVar[str]
    arguments_key: ClassVar[str] = "arguments"

    @abc.abstractmethod
    def streaming_parser(self) -> StreamingToolParser:
        """A fresh streaming parser for one response."""

    @abc.abstractmethod
    def render(self, calls: Sequence[Call]) -> str:
        """The text a model of this family writes for ``calls`` (name, arguments)."""

    @abc.abstractmethod
    def forced(self, tags: list[dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
        """The structural-tag format node for one or more of the call ``tags`` (one when not parallel)."""

    def call_tag(self, name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
        """The ``tag`` node of one call of ``name``: its JSON object, arguments per its schema."""
        begin = f'{{"name": {json.dumps(name)}, "{self.arguments_key}": '
        content = {"type": "json_schema", "json_schema": dict(parameters)}
        return {"type": "tag", "begin": begin, "content": content, "end": "}"}

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

        ``"required"`` forces one or more calls of any tool (exactly one when not ``parallel``);
        a named function forces exactly one call of it. Arguments follow each tool's schema.
        """
        functions = {f["name"]: f.get("parameters") or {"type": "object"} for f in map(_function, tools)}
        if tool_choice == "required" and not functions:
            raise ValueError('"required" needs at least one tool')
        if tool_choice in (None, "auto", "none"):
            return None
        if tool_choice == "required":
            tags = [self.call_tag(n, p) for n, p in functions.items()]
            return {"type": "structural_tag", "format": self.forced(tags, parallel=parallel)}
        name = _chosen_name(tool_choice)
        if name not in functions:
            raise ValueError(f"names {name!r}, which is not among the tools")
        tag = self.call_tag(name, functions[name])
        return {"type": "structural_tag", "format": self.forced([tag], parallel=False)}

    def tools_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """A system-prompt section listing ``tools`` and showing how to call them in this format."""
        listed = "\n".join(json.dumps(_function(t), ensure_ascii=False) for t in tools)
        example = self.render([("function_name", {"argument": "value"})])
        return (
            "You may call functions to answer. The functions, as JSON, inside <tools></tools>:\n"
            f"<tools>\n{listed}\n</tools>\n"
            f"To call functions, reply with only the calls, written like this:\n{example}\n"
            "Otherwise reply normally."
        )


def _separated(tags: list[dict[str, Any]], separator: str, *, parallel: bool) -> dict[str, Any]:
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }


def _wrapped(begin: str, inner: dict[str, Any], end: str) -> dict[str, Any]:
    elements = [{"type": "const_string", "value": begin}, inner, {"type": "const_string", "value": end}]
    return {"type": "sequence", "elements": elements}


def _call_json(name: str, arguments: Mapping[str, Any], key: str = "arguments") -> str:
    return json.dumps({"name": name, key: dict(arguments)}, ensure_ascii=False)


class QwenToolCallFormat(ToolCallFormat):
    """One ``<tool_call>`` block per call, blocks separated by a newline."""

    name = "qwen"

    def streaming_parser(self) -> StreamingToolParser:
        return MarkedStreamingParser("<tool_call>", "</tool_call>")

    def render(self, calls: Sequence[Call]) -> str:
        return "\n".join(f"<tool_call>\n{_call_json(n, a)}\n</tool_call>" for n, a in calls)

    def forced(self, tags: list[dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
        blocks = [dict(t, begin="<tool_call>\n" + t["begin"], end=t["end"] + "\n</tool_call>") for t in tags]
        return _separated(blocks, "\n", parallel=parallel)


class SmolLM2ToolCallFormat(ToolCallFormat):
    """All calls as one JSON list inside a single ``<tool_call>`` block.

    The forced grammar keeps that shape: after a call the model chooses between ``,`` (another call)
    and ``]`` (done). Separate blocks one after another are a shape this family was not trained on;
    forced that way, a small model repeats the same block until ``max_tokens``.
    """

    name = "smollm2"

    def streaming_parser(self) -> StreamingToolParser:
        return MarkedStreamingParser("<tool_call>", "</tool_call>")

    def render(self, calls: Sequence[Call]) -> str:
        return "<tool_call>[" + ", ".join(_call_json(n, a) for n, a in calls) + "]</tool_call>"

    def forced(self, tags: list[dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
        return _wrapped("<tool_call>[", _separated(tags, ", ", parallel=parallel), "]</tool_call>")


class MistralToolCallFormat(ToolCallFormat):
    """``[TOOL_CALLS]`` then a JSON list of calls; the list's closing bracket ends the calls."""

    name = "mistral"

    def streaming_parser(self) -> StreamingToolParser:
        return MarkedStreamingParser("[TOOL_CALLS]", None)

    def render(self, calls: Sequence[Call]) -> str:
        return "[TOOL_CALLS] [" + ", ".join(_call_json(n, a) for n, a in calls) + "]"

    def forced(self, tags: list[dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
        return _wrapped("[TOOL_CALLS] [", _separated(tags, ", ", parallel=parallel), "]")


class Llama3ToolCallFormat(ToolCallFormat):
    """A response that starts with ``{`` is a call (or several separated by ``;``)."""

    name = "llama3"
    arguments_key = "parameters"

    def streaming_parser(self) -> StreamingToolParser:
        return BareJsonStreamingParser()

    def render(self, calls: Sequence[Call]) -> str:
        return "; ".join(_call_json(n, a, "parameters") for n, a in calls)

    def forced(self, tags: list[dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
        return _separated(tags, "; ", parallel=parallel)


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    fmt.name: fmt
    for fmt in (
        QwenToolCallFormat(),
        SmolLM2ToolCallFormat(),
        Llama3ToolCallFormat(),
        MistralToolCallFormat(),
    )
}


def get_tool_call_format(name: str) -> ToolCallFormat:
    """The format registered as ``name`` (``qwen``, ``smollm2``, ``llama3``, ``mistral``)."""
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
    raise ValueError(f'must be "auto", "none", "required" or name a function, got {tool_choice!r}')
