"""Bodies of the native routes (SGLang's wire names).

Models are strict (no string -> number or bool -> int coercion) and ignore unknown keys, so clients
sending SGLang fields we do not use still work. They check types only: what a ``/generate`` body
means (batches, ``n``, request ids, sampling params) is :mod:`phloem.runtime.expand`'s business.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

IntList = list[int]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class GenerateBody(_Body):
    """The JSON form of :class:`phloem.runtime.expand.GenerateCall` (same fields)."""

    text: str | list[str] | None = None
    input_ids: IntList | list[IntList] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: IntList | list[IntList] | None = None
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    priority: int | None = None
    extra_key: str | None = None


class TokenizeBody(_Body):
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeBody(_Body):
    tokens: IntList | list[IntList]
    skip_special_tokens: bool = True


class AbortBody(_Body):
    rid: str | list[str] | None = None
    abort_all: bool = False


class FlushCacheBody(_Body):
    timeout: float | None = Field(default=None, ge=0)


class UpdateWeightsFromDiskBody(_Body):
    model_path: str = Field(min_length=1)  # a GGUF file or a Hugging Face folder on the engine's disk
    load_format: str | None = None  # auto (the default), gguf or safetensors
    abort_all_requests: bool = False  # abort running requests instead of waiting for them


class UpdateWeightsFromTensorBody(_Body):
    """Named tensors (Hugging Face names, any subset of the model's) as safetensors: a file the
    engine can read, or the file's bytes base64-encoded (small updates). One of the two."""

    tensor_file: str | None = Field(default=None, min_length=1)
    safetensors_b64: str | None = Field(default=None, min_length=1)
    abort_all_requests: bool = False
    serialized_named_tensors: Any = None  # SGLang's pickled form: declared only to be refused
