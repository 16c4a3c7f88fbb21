"""③ The scheduler process: owns the model runner, the caches and the ``Scheduler``; speaks ZMQ.

The ``Scheduler`` class is pure bookkeeping; this module turns messages into calls on it, sends
control replies and periodic stats to the tokenizer manager, and keeps the loop alive. A heartbeat
thread (``heartbeat.py``) tells the manager the process lives and how old the loop's last iteration
is, and ends the process when one iteration never ends (``--watchdog-timeout``).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq
from phloem.runtime import switches
from phloem.runtime.config import EngineArgs
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.ipc import IpcPaths, parent_alive, pull_socket, push_socket
from phloem.runtime.messages import (
    MEMORY_TAGS,
    PAUSE_MODES,
    AbortReq,
    Codec,
    ContinueGenerationReq,
    ControlReply,
    DestroyWeightsGroupReq,
    FlushCacheReq,
    GetStatsReq,
    GetWeightsReq,
    Heartbeat,
    InitWeightsGroupReq,
    MemoryOccupationReq,
    PauseGenerationReq,
    PrefixReportReq,
    Ready,
    SchedulerStats,
    ShutdownReq,
    ToDetokenizer,
    TokenizedGenerateReq,
    ToScheduler,
    ToTokenizerManager,
    UpdateWeightsFromDistributedReq,
    UpdateWeightsReq,
)
from phloem.runtime.sampling.stop import StopChecker
from phloem.runtime.scheduler.admission_report import prefix_report
from phloem.runtime.scheduler.heartbeat import HeartbeatThread, LoopWatch
from phloem.runtime.scheduler.req import Req
from phloem.runtime.scheduler.scheduler import Scheduler, StepTimes
from phloem.runtime.scheduler.weight_sync import Finished, WeightSync

logger = logging.getLogger("phloem.scheduler")

STATS_INTERVAL_S = 1.0
ENV_LOOP_TRACE = switches.LOOP_TRACE.name


class LoopTrace:
    """One line per busy loop iteration, written to ``$PHLOEM_LOOP_TRACE`` (a diagnosis aid,
    off by default): when it began (ms since the first), how long receiving took and how many
    messages came, then the step's parts (``StepTimes``), all in ms. Idle polls are skipped."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "w")  # noqa: SIM115 (open for the process's life)
        self._f.write("t_ms recv_ms msgs kind rows schedule_ms launch_ms process_ms\n")
        self._origin: float | None = None

    @classmethod
    def from_env(cls) -> LoopTrace | None:
        path = switches.LOOP_TRACE.text()
        return cls(path) if path else None

    def add(self, t0: float, t1: float, t2: float, msgs: int, st: StepTimes) -> None:
        if not msgs and not st.kind and t2 - t1 < 1e-3:
            return  # an idle poll
        if self._origin is None:
            self._origin = t0
        self._f.write(
            f"{(t0 - self._origin) * 1e3:.2f} {(t1 - t0) * 1e3:.2f} {msgs} {st.kind or '-'} {st.rows} "
            f"{st.schedule * 1e3:.2f} {st.launch * 1e3:.2f} {st.process * 1e3:.2f}\n"
        )
        self._f.flush()  # the process may end by signal: keep every line written


class SchedulerProcess:
    def __init__(self, scheduler: Scheduler, *, runtime: Any, ipc: IpcPaths, ctx: zmq.Context) -> None:
        self.scheduler = scheduler
        self.rt = runtime  # SchedulerRuntime: runner, tokenizer, cache, ...
        self.inp = pull_socket(ctx, ipc.scheduler)
        self.to_tm = push_socket(ctx, ipc.tokenizer_manager)
        self.codec_in = Codec(ToScheduler)
        self.codec_tm = Codec(ToTokenizerManager)
        self.running = True
        self.watch = LoopWatch(lambda: scheduler.doing)
        self._last_stats = 0.0
        self._idle_checked = True
        self._received = 0  # messages handled by the last receive()
        # Weight updates wait until no request runs; requests that arrive meanwhile are held
        # here and admitted after the update, so they run on the new weights and a steady
        # stream of them cannot keep the update waiting forever.
        self._weight_updates: list[UpdateWeightsReq] = []
        self._tensors: dict[int, dict[str, Any]] = {}  # parsed tensors of queued updates, by req_id
        self._held: list[TokenizedGenerateReq] = []
        self.weight_sync = WeightSync(runtime.runner.device)  # groups a trainer broadcasts over
        # A weight update applied while paused requests held KV could not flush the prefix cache
        # (their nodes are locked): it is flushed once nothing holds KV any more.
        self._flush_pending = False
        self._memory: Any = None  # MemoryOccupation, made on the first release
        self.handlers = {
            TokenizedGenerateReq: self._on_generate,
            AbortReq: self._on_abort,
            FlushCacheReq: self._on_flush,
            GetStatsReq: self._on_stats,
            PrefixReportReq: self._on_prefix_report,
            UpdateWeightsReq: self._on_update_weights,
            InitWeightsGroupReq: self._on_group_request,
            UpdateWeightsFromDistributedReq: self._on_group_request,
            DestroyWeightsGroupReq: self._on_group_request,
            GetWeightsReq: self._on_get_weights,
            PauseGenerationReq: self._on_pause,
            ContinueGenerationReq: self._on_continue,
            MemoryOccupationReq: self._on_memory,
            ShutdownReq: self._on_shutdown,
        }

    # ------------------------------------------------------------------ loop
    def loop(self, parent_pid: int) -> None:
        trace = LoopTrace.from_env()
        self.scheduler.record_step_times = trace is not None
        while self.running:
            self.watch.stamp()  # one iteration completed (the heartbeat reports its age)
            idle = self.scheduler.is_idle
            t0 = time.perf_counter()
            self.scheduler.doing = ("receive", "")
            # while paused or released nothing can run: wait for messages instead of spinning
            arrived = self.receive(block=idle or self.scheduler.stopped)
            t1 = time.perf_counter()
            busy = self.scheduler.step()
            self.after_step()
            if trace is not None:
                trace.add(t0, t1, time.perf_counter(), self._received, self.scheduler.last_step)
            if busy or arrived:
                self._idle_checked = False
            elif idle and not self._idle_checked:
                # Idle for a whole poll interval: check the pool invariant (free + evictable ==
                # total) now. It is O(pool size), ~0.1 s on a large GPU pool; checking the moment
                # the last request finished would delay the next one, which often follows at once.
                self.rt.cache.check_integrity()
                self._idle_checked = True
            now = time.monotonic()
            if now - self._last_stats >= STATS_INTERVAL_S:
                self._last_stats = now
                grammar = self.scheduler.grammar
                self._send_tm(
                    SchedulerStats(
                        stats=self.scheduler.live_stats(),
                        grammar_compilation_times=grammar.take_compile_times() if grammar else [],
                    )
                )
                if not parent_alive(parent_pid):
                    return

    def after_step(self) -> None:
        """Queued weight updates run once no step can be in flight: idle, or paused (requests
        paused in place or retracted are held, not waited for); a flush left pending by one runs
        once nothing holds KV."""
        if self._weight_updates and (self.scheduler.is_idle or self.scheduler.stopped):
            self._run_weight_updates()
        if self._flush_pending and self.scheduler.flush_unheld():
            self._flush_pending = False

    def receive(self, *, block: bool) -> bool:
        """Handle every waiting message (waiting up to 200 ms for one when ``block``); whether any
        came. A message's frames are messages sent together (the tokenizer manager's requests of
        one event-loop turn), handled in order. Group jobs finished since the last call (a join,
        a received broadcast) are answered or queued first."""
        timeout = 200 if block else 0
        self._received = 0
        if self.weight_sync.pending:  # joins and broadcasts finished on the group thread
            for done in self.weight_sync.finished():
                self._on_group_job_done(done)
        while self.inp.poll(timeout):
            for frame in self.inp.recv_multipart():
                msg = self.codec_in.decode(frame)
                self.scheduler.doing = ("handle", type(msg).__name__)
                if type(msg) in _SINGLE_RANK_ONLY and self.rt.runner.tp.size > 1:
                    self._send_tm(ControlReply(req_id=msg.req_id, ok=False, message=_SINGLE_RANK_MESSAGE))
                else:
                    self.handlers[type(msg)](msg)
                self._received += 1
            timeout = 0
        return self._received > 0

    # ------------------------------------------------------------------ handlers
    def _on_generate(self, msg: TokenizedGenerateReq) -> None:
        if self._weight_updates:
            self._held.append(msg)
            return
        self._admit(msg)

    def _admit(self, msg: TokenizedGenerateReq) -> None:
        params = msg.sampling_params
        req = Req(
            rid=msg.rid,
            origin_input_ids=list(msg.input_ids),
            params=params,
            stop_checker=StopChecker(params, eos_token_ids=self.rt.eos_token_ids, tokenizer=self.rt.tokenizer),
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
            token_ids_logprob=msg.token_ids_logprob,
            stream=msg.stream,
            priority=msg.priority or 0,
            extra_key=msg.extra_key,
            return_prefix_report=msg.return_prefix_report,
        )
        self.scheduler.add_request(req)

    def _on_abort(self, msg: AbortReq) -> None:
        self._admit_held(lambda m: msg.abort_all or m.rid == msg.rid)
        self.scheduler.abort(msg.rid, abort_all=msg.abort_all, message=msg.message, status_code=msg.status_code)

    def _admit_held(self, which: Any) -> None:
        """Admit the held requests ``which(msg)`` picks, so that an abort finishes them like any other."""
        for held in [m for m in self._held if which(m)]:
            self._held.remove(held)
            self._admit(held)

    def _on_pause(self, msg: PauseGenerationReq) -> None:
        if msg.mode not in PAUSE_MODES:  # the manager's callers check it; never end the loop over it
            message = f"mode: must be one of {', '.join(PAUSE_MODES)}"
            self._send_tm(ControlReply(req_id=msg.req_id, ok=False, message=message, data={"field": "mode"}))
            return
        if msg.mode == "abort":
            self._admit_held(lambda m: True)
        self.scheduler.pause(msg.mode)
        self._send_tm(ControlReply(req_id=msg.req_id, ok=True, message=f"generation paused (mode {msg.mode})"))

    def _on_continue(self, msg: ContinueGenerationReq) -> None:
        self.scheduler.resume()
        self._send_tm(ControlReply(req_id=msg.req_id, ok=True, message="generation continued"))

    def _on_memory(self, msg: MemoryOccupationReq) -> None:
        """Release or take back device memory (``MemoryOccupation``). A release is refused while a
        request holds KV; releasing the KV pool empties the prefix cache first."""
        from phloem.runtime.executor.memory_occupation import MemoryOccupation

        if self._memory is None:
            self._memory = MemoryOccupation(self.rt.runner)
        if not set(msg.tags) <= set(MEMORY_TAGS):
            message = f"tags: choose from {', '.join(MEMORY_TAGS)}"
            self._send_tm(ControlReply(req_id=msg.req_id, ok=False, message=message, data={"field": "tags"}))
            return
        if msg.release and self.scheduler.holds_kv:
            message = "requests are running: pause generation (mode 'retract' or 'abort') or wait until idle first"
            self._send_tm(ControlReply(req_id=msg.req_id, ok=False, message=message, data={"field": "tags"}))
            return
        if msg.release and self._weight_updates:
            self._run_weight_updates()  # queued before the release: applied while the weights are here
        try:
            if msg.release:
                if "kv_cache" in msg.tags and not self.scheduler.flush_unheld():
                    raise RuntimeError("the prefix cache could not be flushed")
                message = self._memory.release(msg.tags)
            else:
                message = self._memory.resume(msg.tags)
        except Exception:
            logger.error("memory occupation change failed:\n%s", traceback.format_exc())
            reply = ControlReply(req_id=msg.req_id, ok=False, message="internal error", data={"internal": True})
        else:
            reply = ControlReply(req_id=msg.req_id, ok=True, message=message)
        self.scheduler.released = set(self._memory.released)
        self._send_tm(reply)

    def _on_flush(self, msg: FlushCacheReq) -> None:
        ok = self.scheduler.flush_cache()
        self._send_tm(ControlReply(req_id=msg.req_id, ok=ok, message="" if ok else "requests are running"))

    def _on_stats(self, msg: GetStatsReq) -> None:
        self._send_tm(ControlReply(req_id=msg.req_id, ok=True, data=self.scheduler.live_stats()))

    def _on_prefix_report(self, msg: PrefixReportReq) -> None:
        report = prefix_report(self.rt.cache.tree, msg.input_ids, extra_key=msg.extra_key)
        self._send_tm(ControlReply(req_id=msg.req_id, ok=True, data=report))

    def _on_update_weights(self, msg: UpdateWeightsReq) -> None:
        """Check what can be checked now (a bad path, format, tensor name or shape is refused
        before anything waits or is aborted), then queue the update; it runs once no request is
        running (:meth:`_run_weight_updates`). With ``abort_all_requests`` the running requests
        are aborted now instead of finishing."""
        if "weights" in self.scheduler.released:
            self._send_tm(ControlReply(req_id=msg.req_id, ok=False, message=WEIGHTS_RELEASED))
            return
        if self._refused(msg, lambda: self._check_update(msg)):
            return
        if msg.abort_all_requests:
            # 503: the client may retry once the update is done
            self.scheduler.abort(
                None, abort_all=True, message="aborted: the weights are being updated", status_code=503
            )
        self._weight_updates.append(msg)

    def _on_group_request(
        self, msg: InitWeightsGroupReq | UpdateWeightsFromDistributedReq | DestroyWeightsGroupReq
    ) -> None:
        """Check a group request now, then leave its waiting (joining, receiving) to the group
        thread; :meth:`_on_group_job_done` answers. A broadcast update that cannot succeed is
        refused before anything is received."""
        try:
            if isinstance(msg, InitWeightsGroupReq):
                self.weight_sync.start_join(msg)
            elif isinstance(msg, UpdateWeightsFromDistributedReq):
                self.weight_sync.start_receive(msg, self.rt.runner.model)
                if msg.abort_all_requests:
                    self.scheduler.abort(
                        None, abort_all=True, message="aborted: the weights are being updated", status_code=503
                    )
            else:
                self.weight_sync.start_destroy(msg)
        except InvalidRequest as e:
            self._send_tm(_refusal(msg, e))
        except Exception:
            self._send_tm(_fault(msg))

    def _on_group_job_done(self, done: Finished) -> None:
        """Answer a finished join or destroy; a received update is queued like a tensor update
        (applied once no request runs)."""
        msg = done.msg
        joining = isinstance(msg, InitWeightsGroupReq)
        if done.error is not None:
            # the trainer's side failed (unreachable store, a broadcast that never came): the
            # client's to fix, so a refusal naming where the group came from
            what = {InitWeightsGroupReq: "join", UpdateWeightsFromDistributedReq: "receive over"}.get(type(msg), "leave")
            err = InvalidRequest(
                "master_address" if joining else "group_name",
                f"could not {what} group {msg.group_name!r}: {done.error}",
            )
            self._send_tm(_refusal(msg, err))
        elif isinstance(msg, UpdateWeightsFromDistributedReq):
            self._tensors[msg.req_id] = done.result
            self._weight_updates.append(
                UpdateWeightsReq(req_id=msg.req_id, tensor_field="names", flush_cache=msg.flush_cache)
            )
        else:
            message = f"joined group {msg.group_name!r}" if joining else f"left group {msg.group_name!r}"
            self._send_tm(ControlReply(req_id=msg.req_id, ok=True, message=message))

    def _on_get_weights(self, msg: GetWeightsReq) -> None:
        from phloem.runtime.executor.weight_update import weight_values

        if "weights" in self.scheduler.released:
            self._send_tm(ControlReply(req_id=msg.req_id, ok=False, message=WEIGHTS_RELEASED))
            return
        values: list[Any] = []

        def read() -> None:
            values.append(weight_values(self.rt.runner.model, msg.name, msg.truncate_size))

        if not self._refused(msg, read):
            self._send_tm(ControlReply(req_id=msg.req_id, ok=True, data={"values": values[0]}))

    def _refused(self, msg: Any, work: Callable[[], None]) -> bool:
        """Run ``work``; when it raises, answer ``msg`` (a refusal naming the field for an
        ``InvalidRequest``, an internal error otherwise) and return True."""
        try:
            work()
        except InvalidRequest as e:
            self._send_tm(_refusal(msg, e))
            return True
        except Exception:
            self._send_tm(_fault(msg))
            return True
        return False

    def _check_update(self, msg: UpdateWeightsReq) -> None:
        """Raise ``InvalidRequest`` for an update that cannot succeed; tensors sent with the
        message are parsed once here and kept for :meth:`_update_weights`."""
        from phloem.runtime.executor import weight_update as wu

        runner = self.rt.runner
        if msg.model_path is not None:
            runner.update_source(msg.model_path, msg.load_format)
            return
        field = msg.tensor_field
        if msg.tensor_data is None and msg.tensor_file is None and not msg.cuda_ipc:
            raise InvalidRequest(field, "no tensors given")
        tensors = {}
        if msg.tensor_data is not None:
            tensors.update(wu.read_safetensors_bytes(msg.tensor_data, field))
        if msg.tensor_file is not None:
            tensors.update(wu.read_safetensors_file(msg.tensor_file, field))
        if msg.cuda_ipc:
            from phloem.runtime.cuda_ipc import open_shared

            tensors.update({spec.name: open_shared(spec, field) for spec in msg.cuda_ipc})
        wu.plan_named_copy(runner.model, tensors, field)  # names and shapes; nothing is written
        self._tensors[msg.req_id] = tensors

    def _run_weight_updates(self) -> None:
        """Apply the queued updates (the scheduler is idle, or paused with no step in flight),
        flush the prefix cache (its KV came from the old weights), then admit the requests held
        meanwhile. Requests paused in place keep their KV and go on with the new weights on
        continue; the cache is flushed once they no longer hold it."""
        updates, self._weight_updates = self._weight_updates, []
        for msg in updates:
            self._send_tm(self._update_weights(msg))
        if any(msg.flush_cache for msg in updates):
            if not self.scheduler.flush_cache() and not self.scheduler.flush_unheld():
                self._flush_pending = True
        held, self._held = self._held, []
        for req in held:
            self._admit(req)

    def _update_weights(self, msg: UpdateWeightsReq) -> ControlReply:
        runner = self.rt.runner
        try:
            if msg.model_path is not None:
                message = runner.update_weights_from_disk(msg.model_path, msg.load_format)
                return ControlReply(
                    req_id=msg.req_id, ok=True, message=message, data={"model_path": runner.model_source.path}
                )
            message = runner.update_weights_from_tensors(self._tensors.pop(msg.req_id), msg.tensor_field)
            return ControlReply(req_id=msg.req_id, ok=True, message=message)
        except InvalidRequest as e:
            return _refusal(msg, e)
        except Exception:
            return _fault(msg)

    def _on_shutdown(self, msg: ShutdownReq) -> None:
        in_flight = [m.req_id for m in self._weight_updates] + list(self.weight_sync.pending)
        for req_id in in_flight:
            self._send_tm(ControlReply(req_id=req_id, ok=False, message="server is shutting down"))
        self._weight_updates, self._tensors = [], {}
        self.weight_sync.pending.clear()
        held, self._held = self._held, []
        for req in held:
            self._admit(req)  # to be aborted with the rest
        self.scheduler.abort(None, abort_all=True, message="server is shutting down", status_code=503)
        self.scheduler.drain()
        self.rt.send_detokenizer(ShutdownReq())  # after the aborts, on the same ordered channel
        self.running = False

    def _send_tm(self, msg: Any) -> None:
        self.to_tm.send(self.codec_tm.encode(msg))


def heartbeat_sender(ctx: zmq.Context, endpoint: str) -> Any:
    """A send function for the heartbeat thread: its socket is made on first use, on that thread,
    which alone uses it (ZMQ sockets are not shared between threads). Never blocks: a beat the
    manager is not reading is dropped."""
    codec = Codec(ToTokenizerManager)
    sock: zmq.Socket | None = None

    def send(msg: Heartbeat) -> None:
        nonlocal sock
        if sock is None:
            sock = push_socket(ctx, endpoint)
        sock.send(codec.encode(msg), flags=zmq.NOBLOCK)

    return send


WEIGHTS_RELEASED = "the weights are released: resume memory occupation of 'weights' first"


def _refusal(msg: Any, err: InvalidRequest) -> ControlReply:
    """The reply to an update refused for a reason the client can fix."""
    logger.warning("weight update refused: %s", err)
    return ControlReply(req_id=msg.req_id, ok=False, message=str(err), data={"field": err.field})


def _fault(msg: Any) -> ControlReply:
    """The reply to an update that failed inside the engine (called from an ``except`` block): the
    traceback goes to the log, the client learns only that it was an internal error."""
    logger.error("weight update failed:\n%s", traceback.format_exc())
    return ControlReply(req_id=msg.req_id, ok=False, message="internal error", data={"internal": True})

# Requests that read or write the weights or the device memory of rank 0 alone: refused under
# tensor parallelism (each rank holds a shard; the followers would not see them).
_SINGLE_RANK_ONLY = (UpdateWeightsReq, InitWeightsGroupReq, UpdateWeightsFromDistributedReq, GetWeightsReq,
                     MemoryOccupationReq)  # fmt: skip
_SINGLE_RANK_MESSAGE = (
    "not available with --tp-size above 1: weight updates, weight reads and memory release act on one rank"
)


def freeze_startup_heap() -> int:
    """Put every object alive after start-up (model modules, tokenizer tables, caches) out of the
    cyclic collector's reach, and return how many there are.

    Otherwise each full collection rescans them all while the loop waits, stalling every running
    request (``benchmarks/gc_pauses.py`` measures it). Objects made later are collected as usual.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run_scheduler_process(args: EngineArgs, ipc: IpcPaths, parent_pid: int) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s scheduler] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent shuts us down in order
    ctx = zmq.Context()
    to_tm = push_socket(ctx, ipc.tokenizer_manager)
    codec_tm = Codec(ToTokenizerManager)
    try:
        from phloem.runtime.scheduler.builder import build_scheduler
        from phloem.runtime.scheduler.warmup import warm_up_scheduler

        to_detok = push_socket(ctx, ipc.detokenizer)
        codec_detok = Codec(ToDetokenizer)
        def send_detok(m: Any) -> None:
            to_detok.send(codec_detok.encode(m))

        scheduler, runtime = build_scheduler(args, send=send_detok)
        runtime.send_detokenizer = send_detok
        warm_up_scheduler(args, scheduler, runtime)
        proc = SchedulerProcess(scheduler, runtime=runtime, ipc=ipc, ctx=ctx)
    except Exception as e:
        logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        to_tm.send(codec_tm.encode(Ready(who="scheduler", error=f"{type(e).__name__}: {e}")))
        to_tm.close()
        return
    frozen = freeze_startup_heap()
    info = {**runtime.info, "pid": os.getpid(), "gc_frozen_objects": frozen}
    heartbeat = HeartbeatThread(
        proc.watch, heartbeat_sender(ctx, ipc.tokenizer_manager), watchdog_timeout=args.watchdog_timeout
    )
    proc.watch.stamp()
    heartbeat.start()  # before Ready: the manager counts silence from the moment it is serving
    to_tm.send(codec_tm.encode(Ready(who="scheduler", info=info)))
    try:
        proc.loop(parent_pid)
    finally:
        heartbeat.stop()
        scheduler.worker.close()
        runtime.cache.close()  # finishes queued storage writes
        if runtime.tp_steps is not None:
            runtime.tp_steps.stop()  # after the worker's last step: the followers exit
