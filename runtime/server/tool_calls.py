"""Tool calls for ``/v1/chat/completions``: the hook between the route and the formats.

The formats live in ``phloem.grammars.tools`` (``parse_tool_calls``, per-format streaming parsers,
``structural_tag_for``). This module picks the format for the served model, turns parsed calls into
OpenAI's ``tool_calls`` objects (whole, or as streamed deltas) and builds the structural tag that
forces a call when ``tool_choice`` is ``"required"`` or names a function. ``load_parser`` returns
None when the formats are not available; the route then answers 400 "tools are not supported".
"""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

TOOLS_MODULE = "phloem.grammars.tools"
DEFAULT_FORMAT = "qwen"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_format(model_info: Mapping[str, Any]) -> str:
    """The tool-call format of the served model: ``model_info["tool_call_format"]`` if set, else a
    guess from the model's name (SmolLM2, Llama 3), else ``qwen`` (``<tool_call>`` JSON blocks)."""
    fmt = model_info.get("tool_call_format")
    if fmt:
        return str(fmt)
    name = " ".join(str(model_info.get(k) or "") for k in ("served_model_name", "model_path")).lower()
    if "smollm" in name:
        return "smollm2"
    if "llama" in name and "<tool_call>" not in str(model_info.get("chat_template") or ""):
        return "llama3"
    return DEFAULT_FORMAT


class ToolCallParser:
    """Parses one format; ``formats`` is the ``phloem.grammars.tools`` module (or a stand-in)."""

    def __init__(self, formats: Any, fmt: str = DEFAULT_FORMAT) -> None:
        self._formats = formats
        self.format = fmt

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(normal text, OpenAI ``tool_calls``) of a whole response."""
        normal, calls = self._formats.parse_tool_calls(text, format=self.format)
        return normal, [_openai_call(c.name, c.arguments) for c in calls]

    def streaming(self) -> StreamingToolCalls:
        parser = self._formats.get_tool_call_format(self.format).streaming_parser()
        return StreamingToolCalls(parser)

    def constraint(
        self, tools: Sequence[Mapping[str, Any]], tool_choice: Any, *, parallel: bool = True
    ) -> str | None:
        """Structural-tag JSON forcing a call for ``"required"`` / a named function, else None.

        With ``parallel`` false (OpenAI's ``parallel_tool_calls``), ``"required"`` forces exactly
        one call. Raises ValueError when ``tool_choice`` cannot be satisfied by ``tools``.
        """
        spec = self._formats.structural_tag_for(tools, tool_choice, format=self.format, parallel=parallel)
        return None if spec is None else spec.text


class StreamingToolCalls:
    """One choice's stream: text deltas in, (text delta, OpenAI tool-call deltas) out."""

    def __init__(self, parser: Any) -> None:
        self._parser = parser
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        text, deltas = self._parser.feed(delta)
        return text, [self._openai_delta(d) for d in deltas]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        text, deltas = self._parser.finish()
        return text, [self._openai_delta(d) for d in deltas]

    def _openai_delta(self, delta: Any) -> dict[str, Any]:
        if delta.name is None:
            return {"index": delta.index, "function": {"arguments": delta.arguments}}
        self.num_calls += 1
        function = {"name": delta.name, "arguments": delta.arguments}
        return {"index": delta.index, "id": new_call_id(), "type": "function", "function": function}


def _openai_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def load_parser(model_info: Mapping[str, Any]) -> ToolCallParser | None:
    """The parser for the served model, or None when the tool-call formats are not available."""
    try:
        formats = importlib.import_module(TOOLS_MODULE)
    except ImportError:
        return None
    if not callable(getattr(formats, "parse_tool_calls", None)):
        return None
    return ToolCallParser(formats, tool_call_format(model_info))
