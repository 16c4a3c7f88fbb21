"""Bodies of the OpenAI-compatible routes.

Unknown fields are ignored by default (clients written for other providers send many we do not
use); with ``--strict-api`` they are a 400 naming the first one, as the OpenAI API answers
(:func:`unknown_fields`). Wrong types are always a 400 naming the field. The extras after the
OpenAI fields are SGLang's (``top_k``, ``regex`` ...).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None
    logprob_mode: str | None = None  # phloem's own: "raw" or "processed" logprobs
    return_prefix_report: bool = False  # phloem's own: each choice's prefix_report (non-streaming)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class FunctionDef(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


def unknown_fields(body: BaseModel, raw: Any, prefix: str = "") -> list[str]:
    """Paths of the keys in ``raw`` (the JSON ``body`` was parsed from) that no field of ``body``
    or of the models nested in it takes: ``["max_token", "messages[0].nam"]``."""
    if not isinstance(raw, dict):
        return []
    fields = type(body).model_fields
    names = {name: name for name in fields} | {f.alias: name for name, f in fields.items() if f.alias}
    found: list[str] = []
    for key, sub in raw.items():
        if key not in names:
            found.append(f"{prefix}{key}")
            continue
        value = getattr(body, names[key])
        if isinstance(value, BaseModel):
            found += unknown_fields(value, sub, f"{prefix}{key}.")
        elif isinstance(value, list) and isinstance(sub, list):
            for i, (item, sub_item) in enumerate(zip(value, sub)):
                if isinstance(item, BaseModel):
                    found += unknown_fields(item, sub_item, f"{prefix}{key}[{i}].")
    return found
