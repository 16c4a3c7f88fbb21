"""Bodies of the native routes (SGLang's wire names).

Models are strict (no string -> number or bool -> int coercion) and refuse unknown keys: a typo
(``sampling_param``) is a 400 naming it, never a request run on defaults. SGLang's own fields that
this server does not implement are declared: the harmless ones (``log_metrics``, labels) are
accepted and ignored; the others pass only at their defaults (``image_data: null``), otherwise a
400 says the field is not supported. The models check types only: what a ``/generate`` body means
(batches, ``n``, request ids, sampling params) is :mod:`phloem.runtime.expand`'s business.
"""

from __future__ import annotations

from typing import Any, Literal

from phloem.runtime.server.openai_protocol import ChatMessage
from pydantic import BaseModel, ConfigDict, Field

IntList = list[int]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# SGLang ``/generate`` fields this server does not implement: a client may send them at these
# values (SGLang's clients send some of them always); any other value is refused.
UNSUPPORTED_AT_DEFAULT: dict[str, Any] = {
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "input_embeds": None,
    "modalities": None,
    "lora_path": None,
    "lora_id": None,
    "session_params": None,
    "custom_logit_processor": None,
    "return_hidden_states": False,
    "return_entropy": False,
    "return_bytes": False,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "bootstrap_pair_key": None,
    "data_parallel_rank": None,
    "background": False,
}


# SGLang ``/generate`` fields accepted at any value and ignored: they change nothing a client sees
IGNORED_SGLANG_FIELDS = ("log_metrics", "no_logs", "conversation_id", "custom_labels")


class GenerateBody(_Body):
    """The JSON form of :class:`phloem.runtime.expand.GenerateCall` (its fields), plus SGLang's
    fields that this server does not use."""

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
    return_prefix_report: bool = False  # phloem's own: meta_info.prefix_report
    # IGNORED_SGLANG_FIELDS
    log_metrics: bool = True
    no_logs: bool = False
    conversation_id: str | None = None
    custom_labels: dict[str, str] | None = None
    # UNSUPPORTED_AT_DEFAULT: refused at any other value
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    modalities: Any = None
    lora_path: Any = None
    lora_id: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    return_hidden_states: Any = False
    return_entropy: Any = False
    return_bytes: Any = False
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    data_parallel_rank: Any = None
    background: Any = False

    def unsupported(self) -> str | None:
        """The first SGLang field sent at a value this server does not implement, if any."""
        for name, default in UNSUPPORTED_AT_DEFAULT.items():
            value = getattr(self, name)
            if value != default and not (value == [] and default is None):
                return name
        return None


class DebugPrefixBody(_Body):
    """``/debug/prefix``: one prompt, as text, token ids or chat messages (rendered as the chat
    route renders them)."""

    text: str | None = None
    input_ids: IntList | None = None
    messages: list[ChatMessage] | None = None
    extra_key: str | None = None


class TokenizeBody(_Body):
    prompt: str | list[str]
    add_special_tokens: bool = True
    model: str | None = None  # OpenAI-style clients name the model; one is served


class DetokenizeBody(_Body):
    tokens: IntList | list[IntList]
    skip_special_tokens: bool = True
    model: str | None = None


class AbortBody(_Body):
    rid: str | list[str] | None = None
    abort_all: bool = False


class FlushCacheBody(_Body):
    timeout: float | None = Field(default=None, ge=0)


class UpdateWeightsFromDiskBody(_Body):
    model_path: str = Field(min_length=1)  # a GGUF file or a Hugging Face folder on the engine's disk
    load_format: str | None = None  # auto (the default), gguf or safetensors
    abort_all_requests: bool = False  # abort running requests instead of waiting for them
    flush_cache: bool = True  # SGLang's; only true: cached KV came from the old weights
    weight_version: str | None = None  # SGLang's: a label /get_model_info reports afterwards


class UpdateWeightsFromTensorBody(_Body):
    """Named tensors (Hugging Face names, any subset of the model's) as safetensors: a file the
    engine can read, or the file's bytes base64-encoded (small updates). One of the two."""

    tensor_file: str | None = Field(default=None, min_length=1)
    safetensors_b64: str | None = Field(default=None, min_length=1)
    abort_all_requests: bool = False
    flush_cache: bool = True
    weight_version: str | None = None
    serialized_named_tensors: Any = None  # SGLang's pickled form: declared only to be refused
    load_format: str | None = None  # SGLang's; only its default (the tensors' own form)


class InitWeightsUpdateGroupBody(_Body):
    """Join a trainer's process group (the trainer is rank 0 and hosts the store)."""

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)  # this server's rank
    world_size: int = Field(ge=2)  # the trainer plus the server's ranks
    group_name: str = Field(default="weight_update_group", min_length=1)
    backend: Literal["nccl", "gloo"] = "nccl"


class UpdateWeightsFromDistributedBody(_Body):
    """Named tensors (Hugging Face names) that rank 0 broadcasts, in this order."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str] = Field(min_length=1)  # "bfloat16" or "torch.bfloat16", one per name
    shapes: list[list[int]] = Field(min_length=1)
    group_name: str = Field(default="weight_update_group", min_length=1)
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None  # SGLang's: a label /get_model_info reports afterwards
    load_format: str | None = None  # SGLang's; only its default (tensors as broadcast)


class DestroyWeightsUpdateGroupBody(_Body):
    group_name: str = Field(default="weight_update_group", min_length=1)


class GetWeightsByNameBody(_Body):
    name: str = Field(min_length=1)  # a Hugging Face name, as the weight updates take them
    truncate_size: int = Field(default=100, ge=0)  # rows along dim 0
