"""Routes reinforcement-learning trainers drive (SGLang's names and bodies).

``POST /pause_generation`` ``{"mode": "abort" | "retract" | "in_place"}`` stops the scheduler
launching steps (requests sent meanwhile wait); ``POST /continue_generation`` ``{}`` starts it
again. ``POST /release_memory_occupation`` and ``POST /resume_memory_occupation``
``{"tags": ["kv_cache", "weights"] | null}`` (null: both) give the device memory of the KV pool
and/or the weights back while a trainer uses the GPU, and take it again; a release is refused with
400 while requests run. Every answer is ``{"success", "message"}`` (as the weight routes').
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from phloem.runtime.messages import MEMORY_TAGS
from phloem.runtime.server.http_errors import parse_body
from phloem.runtime.server.native import get_tm, require_serving, weights_response
from pydantic import BaseModel, ConfigDict

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class PauseGenerationBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationBody(_Body):
    pass


class MemoryOccupationBody(_Body):
    tags: list[Literal["kv_cache", "weights"]] | None = None  # None: every tag


@router.post("/pause_generation")
async def pause_generation(request: Request) -> Response:
    body = await parse_body(request, PauseGenerationBody)
    tm = get_tm(request)
    require_serving(tm)
    return weights_response(request, await tm.pause_generation(body.mode))


@router.post("/continue_generation")
async def continue_generation(request: Request) -> Response:
    await parse_body(request, ContinueGenerationBody)
    tm = get_tm(request)
    require_serving(tm)
    return weights_response(request, await tm.continue_generation())


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request) -> Response:
    return await _memory(request, release=True)


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request) -> Response:
    return await _memory(request, release=False)


async def _memory(request: Request, *, release: bool) -> Response:
    body = await parse_body(request, MemoryOccupationBody)
    tm = get_tm(request)
    require_serving(tm)
    tags = list(MEMORY_TAGS) if body.tags is None else list(body.tags)
    return weights_response(request, await tm.memory_occupation(release=release, tags=tags))

