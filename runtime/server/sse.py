"""Server-sent events: ``data: {json}\\n\\n`` per chunk, ``data: [DONE]\\n\\n`` at the end."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from phloem.runtime.server.http_errors import ApiError

DONE = b"data: [DONE]\n\n"


def event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def error_event(err: ApiError) -> bytes:
    return event(err.body())


def response(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
