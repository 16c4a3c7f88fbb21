"""② The tokenizer manager: the main process's view of the engine (docs/design.md §2).

It tokenizes and validates each request, keeps a ``ReqState`` with an asyncio event per request
in flight, sends ``TokenizedGenerateReq`` to the scheduler, and turns the detokenizer's
``BatchStrOut`` messages back into SGLang-shaped output dicts. Both the HTTP server and the
in-process ``Engine`` drive it; it runs on one asyncio loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from phloem.runtime.cache.prefix_walk import report_text
from phloem.runtime.config import EngineArgs
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.expand import MAX_TOP_LOGPROBS_NUM
from phloem.runtime.ipc import IpcPaths
from phloem.runtime.messages import (
    MEMORY_TAGS,
    AbortReq,
    BatchStrOut,
    Codec,
    ContinueGenerationReq,
    ControlReply,
    CudaIpcTensor,
    FlushCacheReq,
    GetStatsReq,
    Heartbeat,
    MemoryOccupationReq,
    PauseGenerationReq,
    PrefixReportReq,
    Ready,
    ReqStrOut,
    SchedulerStats,
    ShutdownReq,
    TokenizedGenerateReq,
    ToScheduler,
    ToTokenizerManager,
    UpdateWeightsReq,
)
from phloem.runtime.sampling.params import validate_token_ids
from phloem.runtime.tokenizer.batch_encoder import BatchEncoder
from phloem.runtime.tokenizer.liveness import Liveness
from phloem.runtime.tokenizer.prompt_length import PromptTooLong, encode_within
from phloem.runtime.tokenizer.request import GenerateRequest

logger = logging.getLogger("phloem.tokenizer_manager")

# /server_info waits for the scheduler's live stats while it keeps beating (it answers between
# steps, and one step may be long), but gives up after this much silence: beats come every second.
SERVER_INFO_SILENCE_S = 2.0
CONTROL_TIMEOUT_S = 30.0
# Weight updates, joins and broadcasts: longer than a group operation may wait for the trainer
# (weight_group.GROUP_TIMEOUT_S), so that its failure, not this timeout, answers the client.
WEIGHTS_TIMEOUT_S = 900.0


@dataclass
class ReqState:
    rid: str
    prompt_tokens: int
    return_text_in_logprobs: bool
    return_logprob: bool = False
    created: float = field(default_factory=time.perf_counter)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    logprobs: dict[str, list] = field(default_factory=dict)


_LOGPROB_KEYS = {
    "output_logprobs": "output_token_logprobs",
    "output_top_logprobs": "output_top_logprobs",
    "output_token_ids_logprobs": "output_token_ids_logprobs",
    "input_logprobs": "input_token_logprobs",
    "input_top_logprobs": "input_top_logprobs",
    "input_token_ids_logprobs": "input_token_ids_logprobs",
}


class TokenizerManager:
    def __init__(self, args: EngineArgs, *, tokenizer: Any, ipc: IpcPaths, model_info: dict[str, Any]) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.ipc = ipc
        self.model_info = model_info
        self.context_len: int = int(model_info["context_length"])
        self.vocab_size: int = int(model_info["vocab_size"])
        self.states: dict[str, ReqState] = {}
        self.metrics: Any = None  # ServerMetrics, set by the server
        self.scheduler_info: dict[str, Any] = {}
        self.live_stats: dict[str, float] = {}
        self._status = "starting"
        self.paused = False  # by /pause_generation, until /continue_generation
        self.released: set[str] = set()  # memory tags released, until resumed
        self._broken_reason = ""
        self.liveness = Liveness(watchdog_s=args.watchdog_timeout)
        self._ctrl_ids = itertools.count(1)
        self._ctrl_waiters: dict[int, asyncio.Future[ControlReply]] = {}
        self._ready: dict[str, Ready] = {}
        self._ready_event: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._encoder = _prompt_encoder(tokenizer, lambda: self.context_len, add_special_tokens=True)
        self._raw_encoder = _prompt_encoder(tokenizer, lambda: self.context_len, add_special_tokens=False)
        self._outbox: list[tuple[str | None, bytes]] = []  # (request id or None, encoded message)

    # ================================================================== lifecycle
    async def start(self, *, ready_timeout: float = 600.0, children_alive=None) -> None:
        """Open sockets, start the receive loop, wait until both children report ready."""
        self.ctx = zmq.asyncio.Context()
        self.to_sched = self.ctx.socket(zmq.PUSH)
        self.to_sched.setsockopt(zmq.LINGER, 0)
        self.to_sched.connect(self.ipc.scheduler)
        self.inp = self.ctx.socket(zmq.PULL)
        self.inp.setsockopt(zmq.LINGER, 0)
        self.inp.bind(self.ipc.tokenizer_manager)
        self.codec_sched = Codec(ToScheduler)
        self.codec_in = Codec(ToTokenizerManager)
        self._ready_event = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._recv_loop()))
        deadline = time.monotonic() + ready_timeout
        while not self._ready_event.is_set():
            if children_alive is not None and not children_alive():
                raise RuntimeError("a child process died during startup (see its log above)")
            if time.monotonic() > deadline:
                raise TimeoutError("engine processes did not become ready in time")
            try:
                await asyncio.wait_for(self._ready_event.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass
        errors = [f"{w}: {r.error}" for w, r in self._ready.items() if r.error]
        if errors:
            raise RuntimeError("engine failed to start: " + "; ".join(errors))
        self.scheduler_info = dict(self._ready["scheduler"].info)
        self.liveness.beat()  # silence counts from now: start-up (model load, warm-up) is not a stall
        self._status = "serving"

    def health(self) -> str:
        """``starting``, ``serving``, ``stalled`` (serving, but the scheduler stopped beating or its
        loop stopped moving: see ``Liveness``), ``shutting_down`` or ``broken``."""
        if self._status == "serving" and self.liveness.stall():
            return "stalled"
        return self._status

    def health_message(self) -> str:
        """Why the state is not ``serving`` ("" when nothing more than the state is known)."""
        if self._status == "broken":
            return self._broken_reason
        return self.liveness.stall() if self._status == "serving" else ""

    def heartbeat_age(self) -> float:
        """Seconds since the scheduler's newest heartbeat."""
        return self.liveness.silence()

    def heartbeat_lost(self) -> str:
        """Why the scheduler is given up on (silent for the watchdog timeout), or ""."""
        return self.liveness.lost() if self._status == "serving" else ""

    def mark_broken(self, reason: str) -> None:
        """A child died: fail every pending request loudly and refuse new ones."""
        if self._status == "broken":
            return
        self._status = "broken"
        self._broken_reason = reason
        logger.error("engine is broken: %s", reason)
        for st in list(self.states.values()):
            self._finish_with_abort(st, f"engine failure: {reason}")

    def start_shutdown(self) -> None:
        if self._status == "serving":
            self._status = "shutting_down"
        try:
            self._send(AbortReq(abort_all=True, message="server is shutting down", status_code=503))
        except Exception:
            pass

    async def shutdown(self) -> None:
        self.start_shutdown()
        try:
            self._send(ShutdownReq())
        except Exception:
            pass
        for t in self._tasks:
            t.cancel()
        self._encoder.close()
        self._raw_encoder.close()
        await asyncio.sleep(0)
        self.inp.close()
        self.to_sched.close()
        self.ctx.term()

    # ================================================================== generation
    async def _prompt_ids(self, req: GenerateRequest) -> list[int] | None:
        """The text prompt's ids (:meth:`encode_prompt`); None when :meth:`tokenize_request`
        needs nothing encoded (ids given, or it will refuse the request)."""
        if self.health() != "serving" or req.input_ids is not None or req.text is None:
            return None
        return await self.encode_prompt(req.text)

    async def encode_prompt(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt text, encoded off the loop (``BatchEncoder``).

        A text that cannot fit the context is refused (``InvalidRequest`` naming ``text``)
        before it is encoded when its length in bytes already rules it out, and part-way
        through encoding when a prefix of it does (``encode_within``). A text that fits comes
        back with the ids of a plain encode of the whole text.
        """
        floor_of = getattr(self.tokenizer, "token_floor", None)
        floor = floor_of(text, add_special_tokens) if floor_of is not None else 0
        if floor >= self.context_len:
            raise _over_context(f"at least {floor}", self.context_len)
        encoder = self._encoder if add_special_tokens else self._raw_encoder
        try:
            return await encoder.encode(text)
        except PromptTooLong as e:
            raise _over_context(f"at least {e.at_least}", self.context_len) from None

    def tokenize_request(self, req: GenerateRequest, text_ids: list[int] | None = None) -> TokenizedGenerateReq:
        """Validate and tokenize (``text_ids``: the text already encoded); raises InvalidRequest
        naming the field."""
        state = self.health()
        if state != "serving":
            why = self.health_message()
            raise InvalidRequest("", f"server is {state}" + (f": {why}" if why else ""))
        if req.input_ids is not None:
            ids = list(req.input_ids)
            validate_token_ids(ids, self.vocab_size, "input_ids")
        elif req.text is not None:
            ids = text_ids if text_ids is not None else self.tokenizer.encode(req.text, add_special_tokens=True)
        else:
            raise InvalidRequest("text", "either text or input_ids is required")
        if not ids:
            raise InvalidRequest("text" if req.input_ids is None else "input_ids", "the prompt is empty")
        p = req.sampling_params
        p.validate_vocab(self.vocab_size)
        if p.grammar is not None:
            self._validate_grammar(*p.grammar)
        if len(ids) >= self.context_len:
            raise _over_context(len(ids), self.context_len, "text" if req.input_ids is None else "input_ids")
        if len(ids) + p.max_new_tokens > self.context_len:
            # the field is named by the error's prefix, in the client's own words (max_tokens on
            # the OpenAI routes), so the text does not name it again
            raise InvalidRequest(
                "sampling_params.max_new_tokens",
                f"{p.max_new_tokens} new tokens after a prompt of {len(ids)} exceed the context length "
                f"{self.context_len} (at most {self.context_len - len(ids)} fit)",
            )
        if req.logprob_start_len >= len(ids):
            raise InvalidRequest(
                "logprob_start_len", f"must be < the prompt length {len(ids)}, got {req.logprob_start_len}"
            )
        if req.logprob_start_len < -1:
            raise InvalidRequest("logprob_start_len", f"must be >= -1, got {req.logprob_start_len}")
        if not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS_NUM:
            raise InvalidRequest(
                "top_logprobs_num", f"must be in [0, {MAX_TOP_LOGPROBS_NUM}], got {req.top_logprobs_num}"
            )
        if req.token_ids_logprob is not None:
            validate_token_ids(req.token_ids_logprob, self.vocab_size, "token_ids_logprob")
        rid = req.rid or uuid.uuid4().hex
        if rid in self.states:
            raise InvalidRequest("rid", f"a request with rid {rid!r} is already running")
        return TokenizedGenerateReq(
            rid=rid,
            input_ids=ids,
            sampling_params=p,
            return_logprob=req.return_logprob,
            logprob_start_len=req.logprob_start_len,
            top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
            token_ids_logprob=req.token_ids_logprob if req.return_logprob else None,
            stream=req.stream,
            priority=req.priority,
            extra_key=req.extra_key,
            arrival_time=time.time(),
            return_prefix_report=req.return_prefix_report,
        )

    def _validate_grammar(self, kind: str, text: str) -> None:
        """Cheap checks here (size, nesting, NUL bytes) give a synchronous 400; compile errors
        come back from the scheduler's grammar queue as an abort with status 400."""
        field = f"sampling_params.{kind}"
        if self.args.grammar_backend == "none":
            raise InvalidRequest(field, "constrained decoding is disabled (--grammar-backend none)")
        from phloem.grammars.base import GrammarError, GrammarSpec
        from phloem.grammars.manager import validate_spec

        try:
            validate_spec(GrammarSpec(kind, text))
        except (GrammarError, ValueError) as e:
            raise InvalidRequest(field, str(e)) from None

    async def generate(self, req: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        """Yield cumulative output dicts for one request (one final dict unless streaming).

        Leaving the iteration early (client disconnect, cancellation) aborts the request.
        """
        msg = self.tokenize_request(req, await self._prompt_ids(req))
        st = ReqState(
            rid=msg.rid,
            prompt_tokens=len(msg.input_ids),
            return_text_in_logprobs=req.return_text_in_logprobs,
            return_logprob=req.return_logprob,
        )
        self.states[msg.rid] = st
        self._send(msg)
        try:
            while True:
                await st.event.wait()
                st.event.clear()
                if st.finished:
                    yield self._output(st)
                    return
                if req.stream:
                    yield self._output(st)
        finally:
            if not st.finished:
                self._send(AbortReq(rid=st.rid, message="client disconnected"))
            self.states.pop(st.rid, None)

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        self._send(AbortReq(rid=rid, abort_all=abort_all, message="aborted by request"))

    # ================================================================== control
    async def flush_cache(self, timeout: float | None = None) -> bool:
        deadline = time.monotonic() + (timeout or 0)
        while True:
            reply = await self._control(FlushCacheReq(req_id=next(self._ctrl_ids)))
            if reply.ok or timeout is None or time.monotonic() >= deadline:
                return reply.ok
            await asyncio.sleep(0.05)

    async def prefix_report(self, ids: list[int], *, extra_key: str | None = None) -> dict[str, Any]:
        """Where ``ids`` would stop matching the prefix cache now (``PrefixReportReq``), with text."""
        reply = await self._control(PrefixReportReq(req_id=next(self._ctrl_ids), input_ids=ids, extra_key=extra_key))
        if not reply.ok:
            raise RuntimeError(reply.message)
        return report_text(reply.data, self._decode_window)

    def _decode_window(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False)) if ids else ""

    async def get_server_info(self) -> dict[str, Any]:
        """The configuration, the scheduler's start-up info and its live stats. When the scheduler
        does not answer (stalled, broken), the rest comes at once with ``live`` None and
        ``live_unavailable`` saying why."""
        live, unavailable = await self._live_stats()
        resolved = {k: self.model_info[k] for k in ("model_path", "tokenizer_path") if self.model_info.get(k)}
        figures = live or {}
        return {
            **self.args.public_dict(),  # never a secret (--api-key)
            **self.scheduler_info,
            **resolved,  # the files the model came from, not the (possibly empty) flag
            "status": self.health(),
            "live": live,
            **({"live_unavailable": unavailable} if live is None else {}),
            # what pause_generation and release_memory_occupation left in place (None: unknown)
            "generation_paused": bool(figures.get("generation_paused")) if live else None,
            "memory_released": [t for t in MEMORY_TAGS if figures.get(f"{t}_released")] if live else None,
            # per scheduler, the figures SGLang's clients read under these names
            "internal_states": [{
                "avg_spec_accept_length": figures.get("spec_accept_length", 0.0),
                "last_gen_throughput": figures.get("gen_throughput", 0.0),
            }],
            "version": _version(),
        }  # fmt: skip

    async def _live_stats(self) -> tuple[dict[str, Any] | None, str]:
        """(the scheduler's live stats, "") or (None, why there are none)."""
        state = self.health()
        if state in ("stalled", "broken"):
            return None, f"the server is {state}: {self.health_message()}"
        msg = GetStatsReq(req_id=next(self._ctrl_ids))
        fut: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._ctrl_waiters[msg.req_id] = fut
        deadline = time.monotonic() + CONTROL_TIMEOUT_S
        try:
            self._send(msg)
            while not fut.done():
                await asyncio.wait([fut], timeout=0.1)
                silence = self.liveness.silence()
                if not fut.done() and silence > SERVER_INFO_SILENCE_S:
                    return None, f"the scheduler did not answer: no heartbeat for {silence:.1f} s"
                if not fut.done() and time.monotonic() > deadline:
                    return None, f"the scheduler did not answer within {CONTROL_TIMEOUT_S:g} s"
        finally:
            self._ctrl_waiters.pop(msg.req_id, None)
        reply = fut.result()
        return (reply.data, "") if reply.ok else (None, reply.message)

    async def update_weights_from_disk(
        self, model_path: str, *, load_format: str | None = None, abort_all_requests: bool = False
    ) -> ControlReply:
        """Replace the weights with a checkpoint of the same architecture (see ``UpdateWeightsReq``);
        on success ``model_info["model_path"]`` names it."""
        msg = UpdateWeightsReq(
            req_id=next(self._ctrl_ids),
            model_path=model_path,
            load_format=load_format,
            abort_all_requests=abort_all_requests,
        )
        reply = await self._control(msg, timeout=WEIGHTS_TIMEOUT_S)
        if reply.ok and reply.data.get("model_path"):
            self.model_info["model_path"] = reply.data["model_path"]
        return reply

    async def update_weights_from_tensor(
        self,
        *,
        tensor_file: str | None = None,
        tensor_data: bytes | None = None,
        cuda_ipc: list[CudaIpcTensor] | None = None,
        field: str = "tensor_file",
        abort_all_requests: bool = False,
    ) -> ControlReply:
        """Replace named weights from safetensors (a file the engine reads, or its bytes) and/or
        CUDA tensors shared by IPC handle; ``field`` is the caller's name for them, which a
        refusal names."""
        msg = UpdateWeightsReq(
            req_id=next(self._ctrl_ids),
            tensor_file=tensor_file,
            tensor_data=tensor_data,
            cuda_ipc=cuda_ipc or [],
            tensor_field=field,
            abort_all_requests=abort_all_requests,
        )
        return await self._control(msg, timeout=WEIGHTS_TIMEOUT_S)

    async def weights_control(self, kind: type, **fields: Any) -> ControlReply:
        """Send a weight-group or weight-reading request (``InitWeightsGroupReq``,
        ``UpdateWeightsFromDistributedReq``, ``DestroyWeightsGroupReq``, ``GetWeightsReq``) with
        ``fields``; its reply. Joining and receiving wait on the trainer: the wait is long."""
        return await self._control(kind(req_id=next(self._ctrl_ids), **fields), timeout=WEIGHTS_TIMEOUT_S)

    async def pause_generation(self, mode: str = "abort") -> ControlReply:
        """Stop launching steps (``PauseGenerationReq``); requests sent meanwhile wait."""
        reply = await self._control(PauseGenerationReq(req_id=next(self._ctrl_ids), mode=mode))
        self.paused = self.paused or reply.ok
        return reply

    async def continue_generation(self) -> ControlReply:
        reply = await self._control(ContinueGenerationReq(req_id=next(self._ctrl_ids)))
        self.paused = self.paused and not reply.ok
        return reply

    async def memory_occupation(self, *, release: bool, tags: list[str]) -> ControlReply:
        """Release or take back the device memory of ``tags`` (``MemoryOccupationReq``); taking
        it back may capture the CUDA graphs again, hence the long timeout."""
        msg = MemoryOccupationReq(req_id=next(self._ctrl_ids), release=release, tags=tags)
        reply = await self._control(msg, timeout=600)
        if reply.ok:
            self.released = self.released | set(tags) if release else self.released - set(tags)
        return reply

    def held(self) -> str:
        """Why requests wait without running (paused, memory released), or "" when they run."""
        why = ["generation is paused"] if self.paused else []
        if self.released:
            why.append(f"memory is released ({', '.join(sorted(self.released))})")
        return "; ".join(why)

    async def _control(self, msg: Any, timeout: float = CONTROL_TIMEOUT_S) -> ControlReply:
        if self._status == "broken":
            return ControlReply(req_id=msg.req_id, ok=False, message=f"engine failure: {self._broken_reason}")
        fut: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._ctrl_waiters[msg.req_id] = fut
        self._send(msg)
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._ctrl_waiters.pop(msg.req_id, None)

    # ================================================================== receiving
    def _send(self, msg: Any) -> None:
        """Queue ``msg`` for the scheduler. Requests queued in one turn of the event loop leave
        together at its end (:meth:`_flush`), as the frames of one message: the scheduler reads
        them at once and admits them together, so a batch submitted at once (a list of prompts
        to ``/generate`` or ``Engine.generate``) is prefilled together rather than in whatever
        pieces the scheduler's polls cut it into. Any other message goes at once, after the
        requests queued before it (an abort must follow its request)."""
        rid = msg.rid if isinstance(msg, TokenizedGenerateReq) else None
        self._outbox.append((rid, self.codec_sched.encode(msg)))
        if rid is None:
            self._flush()
        elif len(self._outbox) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send the queued messages as one multipart message. When that fails (the scheduler's
        queue is full, the socket closed), each queued request finishes with an abort its
        client sees, and a control message's sender gets the error."""
        if not self._outbox:
            return
        out, self._outbox = self._outbox, []
        try:
            self.to_sched.send_multipart([frame for _, frame in out], flags=zmq.NOBLOCK)
        except Exception as e:
            for rid, _ in out:
                st = self.states.get(rid) if rid is not None else None
                if st is not None and not st.finished:
                    self._finish_with_abort(st, f"could not reach the scheduler: {type(e).__name__}: {e}")
            if out[-1][0] is None:
                raise

    async def _recv_loop(self) -> None:
        while True:
            data = await self.inp.recv()
            try:
                msg = self.codec_in.decode(data)
                self._dispatch(msg)
            except Exception:
                logger.exception("bad message from a child process")

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchStrOut):
            for o in msg.outs:
                self._on_output(o)
        elif isinstance(msg, Heartbeat):
            self.liveness.beat(msg.loop_age, msg.doing)
        elif isinstance(msg, SchedulerStats):
            self.live_stats = msg.stats
            if self.metrics is not None:
                self.metrics.update_scheduler_stats(
                    {**msg.stats, "grammar_compilation_times": msg.grammar_compilation_times}
                )
        elif isinstance(msg, ControlReply):
            fut = self._ctrl_waiters.get(msg.req_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, Ready):
            self._ready[msg.who] = msg
            if msg.error or len(self._ready) == 2:
                assert self._ready_event is not None
                self._ready_event.set()

    def _on_output(self, o: ReqStrOut) -> None:
        st = self.states.get(o.out.rid)
        if st is None:
            return  # aborted by the client meanwhile
        now = time.perf_counter()
        out = o.out
        st.text += o.text
        st.output_ids.extend(out.new_ids)
        if out.new_ids:
            if st.first_token_time is None:
                st.first_token_time = now
            st.token_times.append(now)
        for src, dst in _LOGPROB_KEYS.items():
            val = getattr(out, src)
            if val:
                st.logprobs.setdefault(dst, []).extend(val)
        st.meta.update(
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            num_retractions=out.num_retractions,
        )
        if out.cached_tokens_details is not None:
            st.meta["cached_tokens_details"] = out.cached_tokens_details
        if out.spec:
            st.meta.update(out.spec)
        if out.prefix_report is not None:
            st.meta["prefix_report"] = report_text(out.prefix_report, self._decode_window)
        if out.finished is not None:
            st.meta["finish_reason"] = out.finished
            st.finished = True
            if out.finished.get("type") == "abort":
                _log_abort(out.rid, out.finished)
            self._observe(st, now)
        st.event.set()

    def _finish_with_abort(self, st: ReqState, message: str, status_code: int = 503) -> None:
        st.meta["finish_reason"] = {"type": "abort", "message": message, "status_code": status_code}
        _log_abort(st.rid, st.meta["finish_reason"])
        st.finished = True
        st.event.set()

    def _observe(self, st: ReqState, now: float) -> None:
        if self.metrics is None:
            return
        ttft = (st.first_token_time or now) - st.created
        itls = [b - a for a, b in zip(st.token_times, st.token_times[1:])]
        self.metrics.observe_request(
            ttft=ttft,
            itls=itls,
            e2e=now - st.created,
            prompt_tokens=st.meta.get("prompt_tokens", st.prompt_tokens),
            completion_tokens=st.meta.get("completion_tokens", 0),
            cached_tokens=st.meta.get("cached_tokens", 0),
        )

    # ================================================================== output shape
    def _output(self, st: ReqState) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": st.rid,
            "finish_reason": st.meta.get("finish_reason") if st.finished else None,
            "prompt_tokens": st.meta.get("prompt_tokens", st.prompt_tokens),
            "completion_tokens": st.meta.get("completion_tokens", len(st.output_ids)),
            "cached_tokens": st.meta.get("cached_tokens", 0),
            "num_retractions": st.meta.get("num_retractions", 0),
            "e2e_latency": time.perf_counter() - st.created,
        }
        for k in ("cached_tokens_details", "spec_accept_length", "spec_accept_rate", "spec_verify_ct", "prefix_report"):
            if k in st.meta:
                meta[k] = st.meta[k]
        if st.return_logprob:
            # every logprob key is present (possibly empty) when logprobs were asked for
            for key in _LOGPROB_KEYS.values():
                meta[key] = self._with_text(key, st.logprobs.get(key, []), st.return_text_in_logprobs)
        return {"text": st.text, "output_ids": list(st.output_ids), "meta_info": meta}

    def _with_text(self, key: str, vals: list, with_text: bool) -> list:
        """Wire triples ``[logprob, token_id, text|None]``; top lists are lists of triples."""
        def triple(pair: list) -> list:
            lp, tok = pair
            return [lp, tok, self.tokenizer.decode([tok], skip_special_tokens=False) if with_text else None]

        if key.endswith("token_logprobs"):
            return [triple(p) for p in vals]
        return [[triple(p) for p in pos] if pos is not None else None for pos in vals]


def _prompt_encoder(
    tokenizer: Any, context_len: Callable[[], int], *, add_special_tokens: bool
) -> BatchEncoder:
    """Encoder of prompt texts; a long text is encoded by :func:`encode_within`, which stops
    as soon as a prefix shows the text cannot fit the context (``context_len()``: read when
    the text is encoded, as the scheduler reports it only once it is ready)."""

    def one(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def batch(texts: Sequence[str]) -> list[list[int]]:
        if hasattr(tokenizer, "encode_batch"):
            return tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [one(t) for t in texts]

    def long(text: str) -> list[int]:  # a batch of one: the Rust tokenizer releases the GIL there
        limit = context_len()
        return encode_within(text, lambda t: batch([t])[0], limit - 1, first_chars=4 * limit)

    return BatchEncoder(one, batch, encode_long=long)


def _over_context(tokens: int | str, context_len: int, field: str = "text") -> InvalidRequest:
    """The refusal of a prompt of ``tokens`` tokens (a count, or ``"at least N"``)."""
    return InvalidRequest(field, f"the prompt has {tokens} tokens; the model's context length is {context_len}")


def _version() -> str:
    from phloem import __version__

    return __version__


def _log_abort(rid: str, reason: dict[str, Any]) -> None:
    """One line an operator can see for every request the engine refused, aborted or failed (the
    client sees the same message)."""
    logger.warning(
        "request %s ended with status %s: %s", rid, reason.get("status_code"), str(reason.get("message"))[:300]
    )
