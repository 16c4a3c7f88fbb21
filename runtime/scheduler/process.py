"""③ The scheduler process: owns the model runner, the caches and the ``Scheduler``; speaks ZMQ.

The ``Scheduler`` class is pure bookkeeping; this module turns messages into calls on it, sends
control replies and periodic stats to the tokenizer manager, and keeps the loop alive.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
import traceback
from typing import Any

import zmq
from phloem.runtime.config import EngineArgs
from phloem.runtime.ipc import IpcPaths, parent_alive, pull_socket, push_socket
from phloem.runtime.messages import (
    AbortReq,
    Codec,
    ControlReply,
    FlushCacheReq,
    GetStatsReq,
    Ready,
    SchedulerStats,
    ShutdownReq,
    ToDetokenizer,
    TokenizedGenerateReq,
    ToScheduler,
    ToTokenizerManager,
    UpdateWeightsReq,
)
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import StopChecker
from phloem.runtime.scheduler.req import Req
from phloem.runtime.scheduler.scheduler import Scheduler

logger = logging.getLogger("phloem.scheduler")

STATS_INTERVAL_S = 1.0


class SchedulerProcess:
    def __init__(self, scheduler: Scheduler, *, runtime: Any, ipc: IpcPaths, ctx: zmq.Context) -> None:
        self.scheduler = scheduler
        self.rt = runtime  # SchedulerRuntime: runner, tokenizer, cache, ...
        self.inp = pull_socket(ctx, ipc.scheduler)
        self.to_tm = push_socket(ctx, ipc.tokenizer_manager)
        self.codec_in = Codec(ToScheduler)
        self.codec_tm = Codec(ToTokenizerManager)
        self.running = True
        self._last_stats = 0.0
        self._idle_checked = True
        self.handlers = {
            TokenizedGenerateReq: self._on_generate,
            AbortReq: self._on_abort,
            FlushCacheReq: self._on_flush,
            GetStatsReq: self._on_stats,
            UpdateWeightsReq: self._on_update_weights,
            ShutdownReq: self._on_shutdown,
        }

    # ------------------------------------------------------------------ loop
    def loop(self, parent_pid: int) -> None:
        while self.running:
            idle = self.scheduler.is_idle
            arrived = self.receive(block=idle)
            busy = self.scheduler.step()
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

    def receive(self, *, block: bool) -> bool:
        """Handle every waiting message (waiting up to 200 ms for one when ``block``); whether any came."""
        timeout = 200 if block else 0
        arrived = False
        while self.inp.poll(timeout):
            msg = self.codec_in.decode(self.inp.recv())
            self.handlers[type(msg)](msg)
            timeout = 0
            arrived = True
        return arrived

    # ------------------------------------------------------------------ handlers
    def _on_generate(self, msg: TokenizedGenerateReq) -> None:
        params = SamplingParams.from_wire(msg.sampling)
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
        )
        self.scheduler.add_request(req)

    def _on_abort(self, msg: AbortReq) -> None:
        self.scheduler.abort(msg.rid, abort_all=msg.abort_all, message=msg.message, status_code=msg.status_code)

    def _on_flush(self, msg: FlushCacheReq) -> None:
        ok = self.scheduler.flush_cache()
        self._send_tm(ControlReply(req_id=msg.req_id, ok=ok, message="" if ok else "requests are running"))

    def _on_stats(self, msg: GetStatsReq) -> None:
        self._send_tm(ControlReply(req_id=msg.req_id, ok=True, data=self.scheduler.live_stats()))

    def _on_update_weights(self, msg: UpdateWeightsReq) -> None:
        if not self.scheduler.is_idle:
            self.scheduler.drain()
        try:
            self.rt.runner.update_weights(model_path=msg.model_path, tensor_file=msg.tensor_file)
            self.scheduler.flush_cache()  # cached KV was computed with the old weights
            self._send_tm(ControlReply(req_id=msg.req_id, ok=True, message="weights updated"))
        except Exception as e:
            self._send_tm(ControlReply(req_id=msg.req_id, ok=False, message=f"{type(e).__name__}: {e}"))

    def _on_shutdown(self, msg: ShutdownReq) -> None:
        self.scheduler.abort(None, abort_all=True, message="server is shutting down", status_code=503)
        self.scheduler.drain()
        self.rt.send_detokenizer(ShutdownReq())  # after the aborts, on the same ordered channel
        self.running = False

    def _send_tm(self, msg: Any) -> None:
        self.to_tm.send(self.codec_tm.encode(msg))


def freeze_startup_heap() -> int:
    """Put every object alive after start-up (model modules, tokenizer tables, caches) out of the
    cyclic collector's reach, and return how many there are.

    Otherwise each full collection rescans them all while the loop waits: with the default model
    on a 2-core CPU, ~175k objects and a 90-130 ms stall of every running request
    (``benchmarks/gc_pauses.py``). Objects made later are collected as usual.
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
    to_tm.send(codec_tm.encode(Ready(who="scheduler", info=info)))
    try:
        proc.loop(parent_pid)
    finally:
        scheduler.worker.close()
        runtime.cache.close()  # finishes queued storage writes
