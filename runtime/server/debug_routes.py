"""``POST /debug/prefix``: where a prompt would stop matching the prefix cache, without running it.

The body names one prompt: ``text`` (encoded as ``/generate`` encodes it), ``input_ids``, or chat
``messages`` (rendered by the chat template as ``/v1/chat/completions`` renders them). The answer
is the ``meta_info.prefix_report`` a request for that prompt would get now
(``runtime/cache/prefix_walk.py``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.server.http_errors import ApiError, parse_body
from phloem.runtime.server.native import check_token_ids, get_tm, require_serving, vocab_size
from phloem.runtime.server.openai_api import template_messages
from phloem.runtime.server.protocol import DebugPrefixBody

router = APIRouter()


@router.post("/debug/prefix")
async def debug_prefix(request: Request) -> Response:
    body = await parse_body(request, DebugPrefixBody)
    given = [name for name in ("text", "input_ids", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        field = given[1] if given else "text"
        raise ApiError(400, f"{field}: give exactly one of text, input_ids or messages", param=field)
    tm = get_tm(request)
    require_serving(tm)
    field = given[0]
    try:
        if body.input_ids is not None:
            ids = list(body.input_ids)
            check_token_ids(ids, vocab_size(tm), "input_ids")
        elif body.text is not None:
            ids = await tm.encode_prompt(body.text)
        else:
            assert body.messages is not None
            if not body.messages:
                raise ApiError(400, "messages: must not be empty", param="messages")
            try:
                prompt = tm.tokenizer.apply_chat_template(
                    template_messages(body.messages), add_generation_prompt=True
                )
            except ApiError:
                raise
            except Exception as exc:
                raise ApiError(400, f"messages: the chat template failed: {exc}", param="messages") from None
            ids = await tm.encode_prompt(prompt, add_special_tokens=False)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param=field) from None
    if not ids:
        raise ApiError(400, f"{field}: the prompt is empty", param=field)
    return JSONResponse(await tm.prefix_report(ids, extra_key=body.extra_key))
