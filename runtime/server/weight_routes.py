"""Routes that sync weights with a trainer over torch.distributed, and read weights back.

``/init_weights_update_group`` joins the trainer's process group, ``/update_weights_from_distributed``
receives the tensors it broadcasts (the trainer calls the route, then broadcasts; the route
answers once every tensor arrived and was copied in), ``/destroy_weights_update_group`` leaves it.
``/get_weights_by_name`` answers the first rows of a weight. The scheduler does the waiting on a
thread of its own; here each route only awaits its reply, so the event loop keeps serving.
Bodies and answers are SGLang's; refusals are 400s naming the field, with ``success: false``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from phloem.runtime.messages import (
    DestroyWeightsGroupReq,
    GetWeightsReq,
    InitWeightsGroupReq,
    UpdateWeightsFromDistributedReq,
)
from phloem.runtime.server.http_errors import ApiError, parse_body
from phloem.runtime.server.native import get_tm, require_serving, weights_failure, weights_response
from phloem.runtime.server.protocol import (
    DestroyWeightsUpdateGroupBody,
    GetWeightsByNameBody,
    InitWeightsUpdateGroupBody,
    UpdateWeightsFromDistributedBody,
)
from pydantic import BaseModel

router = APIRouter()

# body -> the scheduler message carrying the same fields
_MESSAGES: dict[type[BaseModel], type] = {
    InitWeightsUpdateGroupBody: InitWeightsGroupReq,
    UpdateWeightsFromDistributedBody: UpdateWeightsFromDistributedReq,
    DestroyWeightsUpdateGroupBody: DestroyWeightsGroupReq,
}


async def _group_call(request: Request, body_type: type[BaseModel]) -> Response:
    try:
        body = await parse_body(request, body_type)
        require_serving(get_tm(request))
    except ApiError as err:
        return weights_failure(request, err)
    fields = body.model_dump()
    version = fields.pop("weight_version", None)  # the route's to keep, not the scheduler's
    if fields.pop("load_format", None) is not None:
        return weights_failure(
            request, ApiError(400, "load_format: not supported for broadcast tensors", param="load_format")
        )
    reply = await get_tm(request).weights_control(_MESSAGES[body_type], **fields)
    return weights_response(request, reply, version)


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> Response:
    return await _group_call(request, InitWeightsUpdateGroupBody)


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> Response:
    return await _group_call(request, UpdateWeightsFromDistributedBody)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> Response:
    return await _group_call(request, DestroyWeightsUpdateGroupBody)


@router.get("/get_weights_by_name", operation_id="get_weights_by_name_get")
@router.post("/get_weights_by_name", operation_id="get_weights_by_name_post")
async def get_weights_by_name(request: Request) -> Response:
    """The weight's first ``truncate_size`` rows as a (nested) JSON list."""
    try:
        body = await parse_body(request, GetWeightsByNameBody)
        require_serving(get_tm(request))
    except ApiError as err:
        return weights_failure(request, err)
    reply = await get_tm(request).weights_control(GetWeightsReq, name=body.name, truncate_size=body.truncate_size)
    if not reply.ok:
        return weights_response(request, reply)
    return JSONResponse(reply.data["values"])
