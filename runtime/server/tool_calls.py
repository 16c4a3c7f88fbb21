"""Tool calls for ``/v1/chat/completions``: the hook between the route and the formats.

The formats live in ``phloem.grammars.tools`` (parsers, structural tags, call rendering). This module
picks the format for the served model, turns parsed calls into OpenAI's ``tool_calls`` objects (whole,
or as streamed deltas), builds the structural tag that forces a call when ``tool_choice`` is
``"required"`` or names a function, and, for chat templates that do not render tools, writes the
tools and earlier calls into the messages. ``load_parser`` returns None when the formats are not
available; the route then answers 400 "tools are not supported".
"""

from __future__ import annotations

import importlib
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

TOOLS_MODULE = "phloem.grammars.tools"
DEFAULT_FORMAT = "qwen"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_format(model_info: Mapping[str, Any]) -> str:
    """The tool-call format of the served model.

    ``model_info["tool_call_format"]`` if set; else what the chat template writes (``[TOOL_CALLS]``:
    mistral, ``<tool_call>``: qwen); else a guess from the model's name (SmolLM2, Mistral, Llama 3);
    else ``qwen``.
    """
    fmt = model_info.get("tool_call_format")
    if fmt:
        return str(fmt)
    template = str(model_info.get("chat_template") or "")
    name = " ".join(str(model_info.get(k) or "") for k in ("served_model_name", "model_path")).lower()
    if "[TOOL_CALLS]" in template or "mistral" in name:
        return "mistral"
    if "smollm" in name:
        return "smollm2"
    if "<tool_call>" in template:
        return "qwen"
    if "llama" in name or "<|python_tag|>" in template:
        return "llama3"
    return DEFAULT_FORMAT


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template writes the ``tools`` it is given into the prompt."""
    return bool(template) and "tools" in str(template)


class ToolCallParser:
    """Parses one format; ``formats`` is the ``phloem.grammars.tools`` module (or a stand-in)."""

    def __init__(self, formats: Any, fmt: str = DEFAULT_FORMAT) -> None:
        self._formats = formats
        self.format = fmt
        self._format = formats.get_tool_call_format(fmt)

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(normal text, OpenAI ``tool_calls``) of a whole response."""
        normal, calls = self._format.parse(text)
        return normal, [_openai_call(c.name, c.arguments) for c in calls]

    def streaming(self) -> StreamingToolCalls:
        return StreamingToolCalls(self._format.streaming_parser())

    def constraint(
        self, tools: Sequence[Mapping[str, Any]], tool_choice: Any, *, parallel: bool = True
    ) -> str | None:
        """Structural-tag JSON forcing a call for ``"required"`` / a named function, else None.

        With ``parallel`` false (OpenAI's ``parallel_tool_calls``), ``"required"`` forces exactly
        one call. Raises ValueError when ``tool_choice`` cannot be satisfied by ``tools``.
        """
        spec = self._formats.structural_tag_for(tools, tool_choice, format=self.format, parallel=parallel)
        return None if spec is None else spec.text

    def prompt_messages(
        self, messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> list[dict[str, Any]]:
        """``messages`` for a template without tool support: the tools described in the system
        message (when given), earlier calls written into the assistant's text in this format."""
        out = [self._with_calls_as_text(m) for m in messages]
        if not tools:
            return out
        section = self._format.tools_prompt(tools)
        if out and out[0]["role"] == "system":
            first = out[0]
            out[0] = {**first, "content": f"{first['content']}\n\n{section}" if first["content"] else section}
        else:
            out.insert(0, {"role": "system", "content": section})
        return out

    def _with_calls_as_text(self, message: dict[str, Any]) -> dict[str, Any]:
        calls = message.get("tool_calls")
        if message["role"] != "assistant" or not calls:
            return message
        pairs = [(c["function"].get("name", ""), _arguments(c["function"].get("arguments"))) for c in calls]
        rendered = self._format.render(pairs)
        content = message.get("content") or ""
        rest = {k: v for k, v in message.items() if k != "tool_calls"}
        return {**rest, "content": f"{content}\n{rendered}" if content else rendered}


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


def _arguments(value: Any) -> dict[str, Any]:
    """A history call's arguments as an object (clients send them as JSON text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


def load_formats() -> Any | None:
    """The ``phloem.grammars.tools`` module, or None when it is not available."""
    try:
        formats = importlib.import_module(TOOLS_MODULE)
    except ImportError:
        return None
    return formats if callable(getattr(formats, "get_tool_call_format", None)) else None


def load_parser(model_info: Mapping[str, Any]) -> ToolCallParser | None:
    """The parser for the served model, or None when the tool-call formats are not available."""
    formats = load_formats()
    return None if formats is None else ToolCallParser(formats, tool_call_format(model_info))
