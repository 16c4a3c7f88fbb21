"""``POST /parse_function_call``: SGLang's native route that splits model text into text and calls.

Body ``{"text": str, "tool_call_parser": str, "tools": [OpenAI tools]}``; answer
``{"normal_text": str, "calls": [{"name", "parameters" (JSON text), "tool_index"}]}``. ``tool_index``
is the position of the called function in ``tools`` (-1 when the text calls a function that is not
there). Parser names are this runtime's format names plus SGLang's names for the same formats.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from phloem.runtime.server.http_errors import ApiError, parse_body
from phloem.runtime.server.openai_protocol import Tool
from phloem.runtime.server.tool_calls import load_formats
from pydantic import BaseModel, ConfigDict

router = APIRouter()

# SGLang's parser names -> this runtime's format names
PARSER_ALIASES = {"qwen25": "qwen", "qwen3": "qwen", "hermes": "qwen", "llama4": "llama3"}


class ParseFunctionCallBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    text: str
    tool_call_parser: str
    tools: list[Tool]


@router.post("/parse_function_call")
async def parse_function_call(request: Request) -> Response:
    body = await parse_body(request, ParseFunctionCallBody)
    formats = load_formats()
    if formats is None:
        raise ApiError(
            400, "tool_call_parser: tool calls are not supported by this server", param="tool_call_parser"
        )
    name = PARSER_ALIASES.get(body.tool_call_parser, body.tool_call_parser)
    if name not in formats.TOOL_CALL_FORMATS:
        known = ", ".join(sorted([*formats.TOOL_CALL_FORMATS, *PARSER_ALIASES]))
        message = f"tool_call_parser: unknown parser {body.tool_call_parser!r}; choose one of {known}"
        raise ApiError(400, message, param="tool_call_parser")
    normal, calls = formats.parse_tool_calls(body.text, format=name)
    positions = {t.function.name: i for i, t in reversed(list(enumerate(body.tools)))}
    return JSONResponse({"normal_text": normal, "calls": [_call(c, positions) for c in calls]})


def _call(call: Any, positions: dict[str, int]) -> dict[str, Any]:
    return {"name": call.name, "parameters": call.arguments, "tool_index": positions.get(call.name, -1)}
