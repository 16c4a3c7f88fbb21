"""The in-process Engine: the same processes and messages as ``phloem serve``, without HTTP.

``Engine.generate`` takes the fields of a ``POST /generate`` body and returns exactly what the
route returns (a dict, a list for a batch or ``n > 1``, an iterator of cumulative chunks when
streaming); both turn the call into engine requests with :func:`phloem.runtime.expand.expand`.

The tokenizer manager lives on a private asyncio loop in a background thread, so the sync API
works from any thread and the async API (``async_generate``) works from any running loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from phloem.runtime.config import EngineArgs
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.expand import GenerateCall, SamplingSpec, expand, tokenizer_vocab_size
from phloem.runtime.launch import EngineProcesses, launch_engine
from phloem.runtime.messages import MEMORY_TAGS, PAUSE_MODES
from phloem.runtime.tokenizer.manager import TokenizerManager
from phloem.runtime.tokenizer.request import GenerateRequest

if TYPE_CHECKING:
    import torch

_DONE = object()


def _memory_tags(tags: list[str] | None) -> list[str]:
    if tags is None:
        return list(MEMORY_TAGS)
    for tag in tags:
        if tag not in MEMORY_TAGS:
            raise InvalidRequest("tags", f"unknown tag {tag!r}; choose from {', '.join(MEMORY_TAGS)}")
    return list(tags)


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
        sampling_params: SamplingSpec | list[SamplingSpec] = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] = -1,
        top_logprobs_num: int | list[int] = 0,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        return_text_in_logprobs: bool = False,
        rid: str | list[str] | None = None,
        priority: int | None = None,
        extra_key: str | None = None,
        stream: bool = False,
        return_prefix_report: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """What ``POST /generate`` answers for the body with these fields (``prompt`` is its
        ``text``); ``sampling_params`` may also be ``SamplingParams`` objects. Raises
        ``InvalidRequest`` naming the field, as the route answers 400."""
        call = GenerateCall(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            token_ids_logprob=token_ids_logprob,
            return_text_in_logprobs=return_text_in_logprobs,
            rid=rid,
            priority=priority,
            extra_key=extra_key,
            stream=stream,
            return_prefix_report=return_prefix_report,
        )
        reqs, batched = self._expand(call)
        if stream:
            return self._stream_sync(reqs, batched)
        outs = self._call(self._collect(reqs))
        return outs if batched else outs[0]

    async def async_generate(self, prompt: str | list[str] | None = None, **kwargs: Any) -> Any:
        """Awaitable result, or (with ``stream=True``) an async iterator of cumulative chunks;
        the arguments are those of :meth:`generate`."""
        reqs, batched = self._expand(GenerateCall(text=prompt, **kwargs))
        if kwargs.get("stream"):
            return self._stream_async(reqs, batched)
        fut = asyncio.run_coroutine_threadsafe(self._collect(reqs), self._loop)
        outs = await asyncio.wrap_future(fut)
        return outs if batched else outs[0]

    def _expand(self, call: GenerateCall) -> tuple[list[GenerateRequest], bool]:
        return expand(call, tokenizer_vocab_size(self.tm.tokenizer))

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

    def update_weights_from_disk(
        self, model_path: str, *, load_format: str | None = None, abort_all_requests: bool = False
    ) -> tuple[bool, str]:
        """Copy a checkpoint of the same architecture (a GGUF file or a Hugging Face folder) into
        the loaded weights in place, as ``POST /update_weights_from_disk`` does; ``(success,
        message)``. Running requests finish first (or are aborted with ``abort_all_requests``),
        the prefix cache is flushed, and ``get_model_info()["model_path"]`` names the new files."""
        reply = self._call(
            self.tm.update_weights_from_disk(
                model_path, load_format=load_format, abort_all_requests=abort_all_requests
            )
        )
        return reply.ok, reply.message

    def update_weights_from_tensor(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        abort_all_requests: bool = False,
    ) -> tuple[bool, str]:
        """Copy named tensors (Hugging Face names, any subset of the model's) into the loaded
        weights in place; ``(success, message)``.

        On an engine running on CUDA, CUDA tensors are shared by IPC handle (the engine copies
        straight from them; this call holds them until it answers). The others travel as a
        safetensors file in shared memory (``/dev/shm`` where there is one), which the engine
        reads and this call removes once answered: the message carries only the path.
        """
        from phloem.runtime.shm_tensors import shared_safetensors

        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        on_cuda = str(self.tm.scheduler_info.get("device", "cpu")).startswith("cuda")
        shared = [(name, t) for name, t in items if on_cuda and t.is_cuda]
        host = [(name, t) for name, t in items if not (on_cuda and t.is_cuda)]
        ipc = []
        if shared:
            import torch
            from phloem.runtime.cuda_ipc import share

            torch.cuda.synchronize()  # their values must be written before the engine reads them
            ipc = [share(name, t) for name, t in shared]
        with contextlib.ExitStack() as stack:
            path = stack.enter_context(shared_safetensors(host)) if host or not ipc else None
            reply = self._call(
                self.tm.update_weights_from_tensor(
                    tensor_file=path, cuda_ipc=ipc, field="named_tensors", abort_all_requests=abort_all_requests
                )
            )
        return reply.ok, reply.message

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> tuple[bool, str]:
        """Join a trainer's process group as rank ``rank_offset`` (the trainer is rank 0 and
        hosts the store at ``master_address:master_port``), as ``POST /init_weights_update_group``
        does; returns once every rank has joined. ``(success, message)``."""
        from phloem.runtime.messages import InitWeightsGroupReq

        return self._weights_call(
            InitWeightsGroupReq,
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> tuple[bool, str]:
        """Receive the named tensors rank 0 broadcasts over ``group_name`` (in this order) and
        copy them into the weights in place, as ``POST /update_weights_from_distributed`` does.
        Blocks until they arrived: the trainer broadcasts from another thread or process."""
        from phloem.runtime.messages import UpdateWeightsFromDistributedReq

        return self._weights_call(
            UpdateWeightsFromDistributedReq,
            names=list(names),
            dtypes=[str(d).removeprefix("torch.") for d in dtypes],
            shapes=[list(s) for s in shapes],
            group_name=group_name,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
        )

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        from phloem.runtime.messages import DestroyWeightsGroupReq

        return self._weights_call(DestroyWeightsGroupReq, group_name=group_name)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first ``truncate_size`` rows of a weight (a Hugging Face name, as the updates take
        them) as nested lists, as ``POST /get_weights_by_name`` answers. Raises ``InvalidRequest``
        naming the field for an unknown name."""
        from phloem.runtime.errors import InvalidRequest
        from phloem.runtime.messages import GetWeightsReq

        reply = self._call(self.tm.weights_control(GetWeightsReq, name=name, truncate_size=truncate_size))
        if not reply.ok:
            field = reply.data.get("field")
            if field:
                raise InvalidRequest(field, reply.message.removeprefix(f"{field}: "))
            raise RuntimeError(reply.message)
        return reply.data["values"]

    def _weights_call(self, kind: type, **fields: Any) -> tuple[bool, str]:
        reply = self._call(self.tm.weights_control(kind, **fields))
        return reply.ok, reply.message

    # ================================================================== RL trainers
    def pause_generation(self, mode: str = "abort") -> tuple[bool, str]:
        """Stop generating, as ``POST /pause_generation``: ``abort`` ends every request (finish
        reason abort), ``retract`` frees running requests' KV (they are recomputed on continue,
        their output kept), ``in_place`` keeps them as they are. Requests sent while paused wait.
        Weight updates run while paused. ``(success, message)``; raises ``InvalidRequest`` for
        an unknown mode."""
        if mode not in PAUSE_MODES:
            raise InvalidRequest("mode", f"must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        reply = self._call(self.tm.pause_generation(mode))
        return reply.ok, reply.message

    def continue_generation(self) -> tuple[bool, str]:
        reply = self._call(self.tm.continue_generation())
        return reply.ok, reply.message

    def release_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        """Free the device memory of ``tags`` (``kv_cache``, ``weights``; ``None``: both), as
        ``POST /release_memory_occupation``; refused (``success`` False) while requests run.
        Requests sent while released wait for :meth:`resume_memory_occupation`."""
        reply = self._call(self.tm.memory_occupation(release=True, tags=_memory_tags(tags)))
        return reply.ok, reply.message

    def resume_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        reply = self._call(self.tm.memory_occupation(release=False, tags=_memory_tags(tags)))
        return reply.ok, reply.message

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
