"""``OpenAIBackend``: any OpenAI-compatible endpoint (``/chat/completions`` and ``/completions``).

A ``gen`` at the start of an assistant turn becomes a chat completion over the program's messages;
any other ``gen`` is a text completion of the program text. ``select`` needs prompt log probabilities
(``/completions`` with ``echo`` and ``logprobs``); endpoints without them get a clear error.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import requests
from phloem.lang.backends.base import (
    Backend,
    BackendCapabilityError,
    BackendError,
    GenerateOutput,
    GenerateRequest,
    SelectRequest,
    StreamChunk,
)
from phloem.lang.backends.runtime_http import parse_sse
from phloem.lang.chat_template import ChatTemplate
from phloem.lang.choices import ChoiceLogprobs
from phloem.lang.ir import Constraint, SamplingParams

Body = dict[str, Any]


def openai_sampling_body(params: SamplingParams, constraint: Constraint | None) -> Body:
    """Sampling fields of a completions/chat body.

    The DSL's names are OpenAI's where OpenAI has the field; the rest (``top_k``, ``min_p``,
    ``stop_token_ids``, ``regex``, ``ebnf``, ...) go as extra body keys, which SGLang-compatible
    servers accept and strict endpoints reject.
    """
    body: Body = {}
    for name, value in params.set_fields().items():
        body[name] = list(value) if isinstance(value, tuple) else value
    if constraint is None:
        return body
    if constraint.kind == "json_schema":
        schema = json.loads(constraint.spec)
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    else:
        body[constraint.kind] = constraint.spec
    return body


class OpenAIBackend(Backend):
    """Parameters
    ----------
    base_url:
        The API root including ``/v1``, for example ``http://127.0.0.1:30000/v1``.
    model:
        The ``model`` field of every request.
    api_key:
        Bearer token, when the endpoint needs one.
    chat_template:
        Template used to render roles into the program text (the endpoint applies its own for chat
        requests); defaults to the registered ChatML template.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        chat_template: ChatTemplate | None = None,
        timeout: float = 600.0,
    ):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._template = chat_template
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"OpenAIBackend({self.base_url!r}, model={self.model!r})"

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model}

    # -- transport -----------------------------------------------------------------------------

    def _post(self, path: str, body: Body, *, stream: bool = False) -> requests.Response:
        session = getattr(self._local, "session", None) or requests.Session()
        self._local.session = session
        try:
            resp = session.post(
                self.base_url + path, json=body, headers=self._headers, timeout=self.timeout, stream=stream
            )
        except requests.RequestException as exc:
            raise BackendError(f"POST {self.base_url}{path} failed: {exc}") from exc
        if resp.status_code >= 400:
            raise BackendError(f"POST {path} -> HTTP {resp.status_code}: {resp.text[:2000]}")
        return resp

    def _route(self, request: GenerateRequest) -> tuple[str, Body]:
        body: Body = {"model": self.model, **openai_sampling_body(request.params, request.constraint)}
        if request.open_role != "assistant":
            return "/completions", {**body, "prompt": request.text}
        if request.open_role_text:
            raise BackendCapabilityError(
                "OpenAIBackend cannot continue an assistant turn that already has text; put gen() first "
                "in the assistant turn or use RuntimeEndpoint"
            )
        return "/chat/completions", {**body, "messages": list(request.messages)}

    # -- generation ----------------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> GenerateOutput:
        path, body = self._route(request)
        if request.logprobs.return_logprob:
            body.update(_logprob_fields(path, request.logprobs.top_logprobs_num))
        data = self._post(path, body).json()
        choices = sorted(data.get("choices", []), key=lambda c: c.get("index", 0))
        if not choices:
            raise BackendError(f"{path} returned no choices: {str(data)[:500]}")
        metas = tuple(_meta(data, c) for c in choices)
        return GenerateOutput(texts=tuple(_choice_text(c) for c in choices), meta_infos=metas)

    def generate_stream(self, request: GenerateRequest) -> Iterator[StreamChunk]:
        path, body = self._route(request)
        meta: dict[str, Any] = {}
        with self._post(path, {**body, "stream": True}, stream=True) as resp:
            for chunk in parse_sse(resp.iter_lines(decode_unicode=True)):
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {}).get("content") or choice.get("text") or ""
                    meta = _meta(chunk, choice) if choice.get("finish_reason") else meta
                    if delta:
                        yield StreamChunk(delta=delta)
        yield StreamChunk(delta="", meta_info=meta)

    # -- select --------------------------------------------------------------------------------

    def choice_logprobs(self, request: SelectRequest) -> ChoiceLogprobs:
        prompts = [request.prefix + c for c in request.choices]
        conditional = self._echo_logprobs(prompts, boundary=len(request.prefix))
        unconditional = (
            self._echo_logprobs(list(request.choices), boundary=0) if request.unconditional else None
        )
        return ChoiceLogprobs(conditional=conditional, unconditional=unconditional)

    def _echo_logprobs(self, prompts: list[str], *, boundary: int) -> tuple[tuple[float, ...], ...]:
        body = {"model": self.model, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1}
        try:
            data = self._post("/completions", body).json()
            choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
            return tuple(_tokens_after(c["logprobs"], boundary) for c in choices)
        except (BackendError, KeyError, TypeError) as exc:
            raise BackendCapabilityError(
                f"select() needs prompt log probabilities (/completions with echo and logprobs); "
                f"{self.base_url} does not provide them: {exc}"
            ) from exc


def _tokens_after(logprobs: dict[str, Any], boundary: int) -> tuple[float, ...]:
    """Log probs of echoed tokens that end past ``boundary`` (a token straddling it is token-healed in)."""
    out = []
    for token, offset, lp in zip(logprobs["tokens"], logprobs["text_offset"], logprobs["token_logprobs"]):
        if offset + len(token) > boundary and lp is not None:
            out.append(float(lp))
    return tuple(out)


def _logprob_fields(path: str, top: int | None) -> Body:
    if path == "/chat/completions":
        return {"logprobs": True, "top_logprobs": top or 0}
    return {"logprobs": max(top or 0, 1)}


def _choice_text(choice: dict[str, Any]) -> str:
    if "message" in choice:
        return choice["message"].get("content") or ""
    return choice.get("text", "")


def _meta(data: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
    usage = data.get("usage") or {}
    return {
        "id": data.get("id"),
        "finish_reason": choice.get("finish_reason"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "logprobs": choice.get("logprobs"),
    }
