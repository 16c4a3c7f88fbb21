"""The in-process Engine: the same processes and messages as ``phloem serve``, without HTTP.

``Engine.generate`` returns exactly what ``POST /generate`` returns (a dict, a list for a batch or
``n > 1``, an iterator of cumulative chunks when streaming). The tokenizer manager lives on a
private asyncio loop in a background thread, so the sync API works from any thread and the async
API (``async_generate``) works from any running loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
from phloem.runtime.config import EngineArgs
from phloem.runtime.launch import EngineProcesses, launch_engine
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.tokenizer.manager import TokenizerManager
from phloem.runtime.tokenizer.request import GenerateRequest

_DONE = object()


class Engine:
    """Start the engine: ``Engine(model_path=None, **config)``, config names as the CLI flags."""

    def __init__(self, model_path: str | None = None, **config: Any) -> None:
        self.args = EngineArgs.from_kwargs(model_path, **config)
        logging.basicConfig(level=self.args.log_level.upper(), format="[%(asctime)s] %(message)s")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="phloem-engine-loop", daemon=True)
        self._thread.start()
        self._closed = False
        self.tm: TokenizerManager
        self._procs: EngineProcesses
        self.tm, self._procs = self._call(launch_engine(self.args))

    # ================================================================== generation
    def generate(
        self,
        prompt: str | list[str] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | None = None,
        return_text_in_logprobs: bool = False,
        rid: str | list[str] | None = None,
        priority: int | None = None,
        extra_key: str | None = None,
        stream: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        reqs, batched = build_requests(**_args(locals()))
        if stream:
            return self._stream_sync(reqs, batched)
        outs = self._call(self._collect(reqs))
        return outs if batched else outs[0]

    async def async_generate(self, prompt: str | list[str] | None = None, **kwargs: Any) -> Any:
        """Awaitable result, or (with ``stream=True``) an async iterator of cumulative chunks."""
        reqs, batched = build_requests(prompt=prompt, **kwargs)
        if kwargs.get("stream"):
            return self._stream_async(reqs, batched)
        fut = asyncio.run_coroutine_threadsafe(self._collect(reqs), self._loop)
        outs = await asyncio.wrap_future(fut)
        return outs if batched else outs[0]

    async def _collect(self, reqs: list[GenerateRequest]) -> list[dict[str, Any]]:
        async def one(r: GenerateRequest) -> dict[str, Any]:
            last: dict[str, Any] = {}
            async for chunk in self.tm.generate(r):
                last = chunk
            return last

        return list(await asyncio.gather(*(one(r) for r in reqs)))

    def _stream_sync(self, reqs: list[GenerateRequest], batched: bool) -> Iterator[dict[str, Any]]:
        q: queue.Queue[Any] = queue.Queue()
        fut = asyncio.run_coroutine_threadsafe(self._pump(reqs, batched, q.put), self._loop)
        try:
            while True:
                item = q.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            fut.cancel()

    async def _stream_async(self, reqs: list[GenerateRequest], batched: bool) -> AsyncIterator[dict[str, Any]]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        caller = asyncio.get_running_loop()
        fut = asyncio.run_coroutine_threadsafe(
            self._pump(reqs, batched, lambda x: caller.call_soon_threadsafe(q.put_nowait, x)), self._loop
        )
        try:
            while True:
                item = await q.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            fut.cancel()

    async def _pump(self, reqs: list[GenerateRequest], batched: bool, put: Any) -> None:
        async def one(i: int, r: GenerateRequest) -> None:
            async for chunk in self.tm.generate(r):
                if batched:
                    chunk = {**chunk, "index": i}
                put(chunk)

        try:
            await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
        except BaseException as e:
            put(e)
        finally:
            put(_DONE)

    # ================================================================== control
    def abort(self, rid: str) -> None:
        self._loop.call_soon_threadsafe(self.tm.abort, rid)

    def flush_cache(self, timeout: float | None = None) -> bool:
        return self._call(self.tm.flush_cache(timeout))

    def get_server_info(self) -> dict[str, Any]:
        return self._call(self.tm.get_server_info())

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids exactly as ``generate`` would see them for ``text``."""
        return self.tm.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def get_model_info(self) -> dict[str, Any]:
        return dict(self.tm.model_info)

    def update_weights_from_disk(self, model_path: str) -> tuple[bool, str]:
        return self._call(self.tm.update_weights_from_disk(model_path))

    def health(self) -> str:
        return self.tm.health()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self.tm.shutdown(), timeout=10)
        except Exception:
            pass
        self._procs.terminate()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)


def _args(loc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in loc.items() if k not in ("self", "stream")} | {"stream": loc["stream"]}


def build_requests(
    prompt: str | list[str] | None = None,
    *,
    input_ids: list[int] | list[list[int]] | None = None,
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
    return_logprob: bool = False,
    logprob_start_len: int = -1,
    top_logprobs_num: int = 0,
    token_ids_logprob: list[int] | None = None,
    return_text_in_logprobs: bool = False,
    rid: str | list[str] | None = None,
    priority: int | None = None,
    extra_key: str | None = None,
    stream: bool = False,
) -> tuple[list[GenerateRequest], bool]:
    """Expand a single or batch call (and ``n > 1``) into one ``GenerateRequest`` each.

    Returns the requests and whether the caller gets a list back. Raises InvalidRequest.
    """
    from phloem.runtime.errors import InvalidRequest

    if (prompt is None) == (input_ids is None):
        raise InvalidRequest("text", "exactly one of prompt/text and input_ids is required")
    if prompt is not None:
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        prompts: list[tuple[str | None, list[int] | None]] = [(t, None) for t in texts]
        batched = not isinstance(prompt, str)
    else:
        assert input_ids is not None
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        ids_list = input_ids if batched else [input_ids]
        prompts = [(None, list(x)) for x in ids_list]  # type: ignore[arg-type]
    if isinstance(sampling_params, list):
        if len(sampling_params) != len(prompts):
            raise InvalidRequest("sampling_params", "a list of sampling_params must match the batch size")
        params = [SamplingParams.from_wire(p) for p in sampling_params]
    else:
        one = SamplingParams.from_wire(sampling_params)
        params = [one] * len(prompts)
    rids = rid if isinstance(rid, list) else [rid] * len(prompts)
    if len(rids) != len(prompts):
        raise InvalidRequest("rid", "a list of rids must match the batch size")
    reqs: list[GenerateRequest] = []
    for (text, ids), p, r in zip(prompts, params, rids):
        for j in range(p.n):
            # n samples of one seeded request differ from each other but are reproducible
            pj = p if p.sampling_seed is None or j == 0 else msgspec.structs.replace(p, sampling_seed=p.sampling_seed + j)
            reqs.append(
                GenerateRequest(
                    text=text,
                    input_ids=ids,
                    sampling_params=pj,
                    return_logprob=return_logprob,
                    logprob_start_len=logprob_start_len,
                    top_logprobs_num=top_logprobs_num,
                    token_ids_logprob=token_ids_logprob,
                    return_text_in_logprobs=return_text_in_logprobs,
                    rid=(f"{r}-{j}" if p.n > 1 else r) if r else None,
                    priority=priority,
                    extra_key=extra_key,
                    stream=stream,
                )
            )
        batched = batched or p.n > 1
    return reqs, batched
