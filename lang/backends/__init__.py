"""Backends: how programs reach a model (HTTP runtime, in-process engine, OpenAI-compatible API)."""

from __future__ import annotations

from phloem.lang.backends.base import (
    Backend,
    BackendCapabilityError,
    BackendError,
    GenerateOutput,
    GenerateRequest,
    SelectRequest,
    StreamChunk,
)
from phloem.lang.backends.engine import EngineBackend
from phloem.lang.backends.openai import OpenAIBackend
from phloem.lang.backends.runtime_http import RuntimeEndpoint

__all__ = [
    "Backend",
    "BackendCapabilityError",
    "BackendError",
    "EngineBackend",
    "GenerateOutput",
    "GenerateRequest",
    "OpenAIBackend",
    "RuntimeEndpoint",
    "SelectRequest",
    "StreamChunk",
]
