"""``EngineBackend``: the in-process Engine, no HTTP."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from typing import Any

from phloem.lang.backends.native import NativeBackend, Payload

# Native payload keys that are not arguments of Engine.generate.
_PAYLOAD_TO_KWARG = {"text": "prompt"}


class EngineBackend(NativeBackend):
    """Runs programs on an in-process engine.

    The engine needs ``generate(prompt=None, *, input_ids=None, sampling_params=None,
    return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, rid=None,
    stream=False)`` returning the ``/generate`` JSON shape (a list for list prompts; an iterator of
    cumulative chunks when streaming) and ``get_model_info()``. An optional ``tokenize(text)`` returning
    token ids saves a prefill when ``select`` scores choices; so does a ``tokenizer`` (anything with
    ``encode(text, add_special_tokens=True)``), passed here or found as the engine's tokenizer manager's.
    """

    def __init__(self, engine: Any, *, tokenizer: Any = None):
        self.engine = engine
        self._accepted = _keyword_names(engine.generate)
        self._info: dict[str, Any] | None = None
        self._tokenizer = tokenizer if tokenizer is not None else _engine_tokenizer(engine)

    def __repr__(self) -> str:
        return f"EngineBackend({type(self.engine).__name__})"

    def _kwargs(self, payload: Payload) -> dict[str, Any]:
        kwargs = {_PAYLOAD_TO_KWARG.get(k, k): v for k, v in payload.items()}
        if self._accepted is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self._accepted}
        return kwargs

    def _send(self, payload: Payload) -> Payload | list[Payload]:
        return self.engine.generate(**self._kwargs(payload))

    def _send_stream(self, payload: Payload) -> Iterator[Payload]:
        yield from self.engine.generate(**self._kwargs(payload))

    def model_info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = dict(self.engine.get_model_info())
        return self._info

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        tokenize = getattr(self.engine, "tokenize", None)
        if callable(tokenize):
            return [list(tokenize(t)) for t in texts]
        if self._tokenizer is not None:
            # The same call the runtime makes for a text prompt, so the ids match /generate's.
            return [list(self._tokenizer.encode(t, add_special_tokens=True)) for t in texts]
        return super().tokenize(texts)


def _engine_tokenizer(engine: Any) -> Any:
    """Our Engine keeps its tokenizer on its tokenizer manager (``engine.tm.tokenizer``)."""
    tokenizer = getattr(getattr(engine, "tm", None), "tokenizer", None)
    return tokenizer if callable(getattr(tokenizer, "encode", None)) else None


def _keyword_names(fn: Any) -> set[str] | None:
    """Parameter names ``fn`` accepts, or ``None`` when it takes ``**kwargs`` (accept everything)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}
