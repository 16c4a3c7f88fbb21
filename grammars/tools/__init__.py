"""Tool-call formats: structural tags that force calls, (streaming) call parsers, tool prompts."""

from __future__ import annotations

from .calls import ToolCall, ToolCallDelta, merge_deltas, parse_call_payload
from .formats import (
    TOOL_CALL_FORMATS,
    ToolCallFormat,
    get_tool_call_format,
    parse_tool_calls,
    structural_tag_for,
)
from .streaming import StreamingToolParser

__all__ = [
    "TOOL_CALL_FORMATS",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallFormat",
    "get_tool_call_format",
    "merge_deltas",
    "parse_call_payload",
    "parse_tool_calls",
    "structural_tag_for",
]
