"""Tool-call formats: structural tags that force calls, and (streaming) call parsers."""

from __future__ import annotations

from .formats import (
    TOOL_CALL_FORMATS,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolCallFormat,
    get_tool_call_format,
    merge_deltas,
    parse_tool_calls,
    structural_tag_for,
)

__all__ = [
    "TOOL_CALL_FORMATS",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallFormat",
    "get_tool_call_format",
    "merge_deltas",
    "parse_tool_calls",
    "structural_tag_for",
]
