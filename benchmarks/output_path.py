"""What the output path costs: scheduler send -> detokenizer -> tokenizer manager -> Engine caller.

    python benchmarks/output_path.py                 # both parts, batch 1 and 64, 128 tokens each
    python benchmarks/output_path.py --part stages   # in-process stage costs only
    python benchmarks/output_path.py --part pipeline --batch 64 --step-ms 1.6

No model runs. Decode steps are synthetic: every running request gets one token per step (real
token ids of the default model's tokenizer, from an English paragraph with a few multi-byte
characters) and the scheduler's own ``OutputCollector`` turns them into ``BatchTokenOut`` messages,
exactly as a decode step does (a streaming request sends every step, the others once, at the end).

``stages``: the cost of each hop per message, measured in this process on the real objects:
the scheduler's collect + encode and ZMQ send, the detokenizer's decode + ``handle`` + encode, the
tokenizer manager's decode + dispatch plus the waiting ``generate`` coroutines (Engine delivery).

``pipeline``: the real detokenizer process, the real ``TokenizerManager`` and ``Engine``, and a
fake scheduler process that emits the same messages (one step every ``--step-ms``, 0 = as fast as
it can). Reports tokens/s seen by the caller, the time per ``generate()`` call and how long the
scheduler spent in its sends (a blocked send shows up as a large maximum).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

PARAGRAPH = (
    "The committee met on Tuesday to review the budget for next year. After a long discussion about "
    "roads, schools and the new library, the members agreed to raise the maintenance fund by 4.5% "
    "and to ask the café owners on Main Street for their opinion — naïve as that may sound. "
    "Données, 数据 and データ all mean data; the report ends with a short summary of the vote (7 to 2). "
)


def token_stream(tokenizer: Any, n: int, offset: int) -> list[int]:
    """``n`` realistic token ids, starting ``offset`` tokens into the repeated paragraph."""
    ids = tokenizer.encode(PARAGRAPH)
    need = n + offset
    ids = ids * (need // len(ids) + 1)
    return ids[offset : offset + n]


def load_default_tokenizer() -> Any:
    from phloem.runtime.model_files import resolve_model
    from phloem.runtime.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


# ---------------------------------------------------------------------------- the scheduler's side


def make_req(rid: str, *, stream: bool, max_new: int) -> Any:
    from phloem.runtime.sampling.params import SamplingParams
    from phloem.runtime.sampling.stop import StopChecker
    from phloem.runtime.scheduler.req import Req

    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return Req(rid=rid, origin_input_ids=[1, 2, 3, 4, 5, 6, 7, 8], params=params,
               stop_checker=StopChecker(params, eos_token_ids=set()), stream=stream)  # fmt: skip


class SyntheticDecode:
    """Requests in decode: each ``step`` appends one token per request and flushes the collector,
    as the scheduler's result processing does. ``send`` receives each ``BatchTokenOut``."""

    def __init__(self, send: Any, streams: dict[str, list[int]], *, stream: bool) -> None:
        from phloem.runtime.sampling.stop import FinishReason
        from phloem.runtime.scheduler.output import OutputCollector

        self._length = FinishReason.length
        self.collector = OutputCollector(send)
        self.streams = streams
        self.reqs = [make_req(rid, stream=stream, max_new=len(ids)) for rid, ids in streams.items()]

    def step(self) -> bool:
        """One decode step; False once every request has finished."""
        running = [r for r in self.reqs if not r.finished]
        for r in running:
            r.output_ids.append(self.streams[r.rid][len(r.output_ids)])
            if len(r.output_ids) >= r.params.max_new_tokens:
                r.finish(self._length(len(r.output_ids)))
            self.collector.add(r)
        self.collector.flush()
        return bool(running)


# ---------------------------------------------------------------------------- part 1: stages


def _per(total_s: float, n: int) -> float:
    return 1e6 * total_s / max(n, 1)


def stage_costs(tokenizer: Any, *, batch: int, tokens: int, stream: bool) -> dict[str, Any]:
    """Microseconds per message of each hop, in this process."""
    import zmq
    from phloem.runtime.config import EngineArgs
    from phloem.runtime.ipc import IpcPaths, pull_socket, push_socket
    from phloem.runtime.messages import Codec, ToDetokenizer, ToScheduler, ToTokenizerManager
    from phloem.runtime.tokenizer.detokenizer_process import Detokenizer
    from phloem.runtime.tokenizer.manager import TokenizerManager
    from phloem.runtime.tokenizer.request import GenerateRequest

    streams = {f"r{i}": token_stream(tokenizer, tokens, 7 * i) for i in range(batch)}

    # Scheduler: collect + build the message, then encode, then the ZMQ send.
    msgs: list[Any] = []
    decode = SyntheticDecode(msgs.append, streams, stream=stream)
    t = time.perf_counter()
    steps = 0
    while decode.step():
        steps += 1
    collect_s = time.perf_counter() - t
    enc = Codec(ToDetokenizer)
    t = time.perf_counter()
    wire = [enc.encode(m) for m in msgs]
    encode_s = time.perf_counter() - t

    ipc = IpcPaths.fresh()
    ctx = zmq.Context()
    pull = pull_socket(ctx, ipc.detokenizer)
    push = push_socket(ctx, ipc.detokenizer)
    send_s = 0.0
    for w in wire:
        t = time.perf_counter()
        push.send(w)
        send_s += time.perf_counter() - t
        pull.recv()  # keep the queue short; not timed
    push.close()
    pull.close()
    ctx.term()
    ipc.cleanup()

    # Detokenizer: decode, handle, encode for the tokenizer manager.
    detok = Detokenizer(tokenizer)
    dec_in, enc_out = Codec(ToDetokenizer), Codec(ToTokenizerManager)
    t = time.perf_counter()
    str_wire = [enc_out.encode(detok.handle(dec_in.decode(w))) for w in wire]
    detok_s = time.perf_counter() - t

    # Tokenizer manager + Engine delivery: the generate() coroutines of the requests wait on their
    # events; each message is decoded, dispatched, and the woken coroutines run.
    async def tm_side() -> tuple[float, list[dict[str, Any]]]:
        tm = TokenizerManager(EngineArgs(), tokenizer=tokenizer, ipc=IpcPaths.fresh(),
                              model_info={"context_length": 8192, "vocab_size": tokenizer.vocab_size})  # fmt: skip
        tm._status = "serving"
        tm.codec_sched, tm.codec_in = Codec(ToScheduler), Codec(ToTokenizerManager)
        tm.to_sched = _NullSocket()  # type: ignore[assignment]
        finals: list[dict[str, Any]] = []

        async def one(rid: str) -> None:
            from phloem.runtime.sampling.params import SamplingParams

            req = GenerateRequest(input_ids=[1, 2, 3], rid=rid, stream=stream,
                                  sampling_params=SamplingParams(max_new_tokens=tokens))  # fmt: skip
            last: dict[str, Any] = {}
            async for chunk in tm.generate(req):
                last = chunk
            finals.append(last)

        tasks = [asyncio.create_task(one(rid)) for rid in streams]
        await asyncio.sleep(0)
        t = time.perf_counter()
        for w in str_wire:
            tm._dispatch(tm.codec_in.decode(w))
            await asyncio.sleep(0)  # the woken generate() coroutines run here
        await asyncio.gather(*tasks)
        return time.perf_counter() - t, finals

    tm_s, finals = asyncio.run(tm_side())
    texts_ok = all(f["text"] == tokenizer.decode(streams[f["meta_info"]["id"]]) for f in finals)
    n = len(wire)
    return {
        "batch": batch,
        "stream": stream,
        "messages": n,
        "steps": steps,
        "us_per_message": {
            "scheduler_collect": _per(collect_s, steps),
            "scheduler_encode": _per(encode_s, n),
            "scheduler_zmq_send": _per(send_s, n),
            "detokenizer": _per(detok_s, n),
            "tokenizer_manager_and_delivery": _per(tm_s, n),
        },
        "bytes_per_message": sum(len(w) for w in wire) / max(n, 1),
        "texts_match_full_decode": texts_ok,
    }


class _NullSocket:
    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        pass


# ---------------------------------------------------------------------------- part 2: pipeline


def fake_scheduler_process(ipc: Any, parent_pid: int, step_s: float, stats_path: str) -> None:
    """Stands in for the scheduler process: admits every request at once and decodes
    ``max_new_tokens`` synthetic tokens per request, one step every ``step_s`` seconds. It beats
    as the real one does, so the manager's watchdog does not give up on it."""
    import zmq
    from phloem.runtime.config import EngineArgs
    from phloem.runtime.ipc import pull_socket, push_socket
    from phloem.runtime.messages import (
        Codec,
        Ready,
        ShutdownReq,
        ToDetokenizer,
        TokenizedGenerateReq,
        ToScheduler,
        ToTokenizerManager,
    )

    tokenizer = load_default_tokenizer()
    ctx = zmq.Context()
    to_tm, to_detok = push_socket(ctx, ipc.tokenizer_manager), push_socket(ctx, ipc.detokenizer)
    inp = pull_socket(ctx, ipc.scheduler)
    codec_in, codec_detok = Codec(ToScheduler), Codec(ToDetokenizer)
    sends: list[float] = []
    from phloem.runtime.scheduler.heartbeat import HeartbeatThread, LoopWatch
    from phloem.runtime.scheduler.process import heartbeat_sender

    watch = LoopWatch()
    beats = heartbeat_sender(ctx, ipc.tokenizer_manager)
    HeartbeatThread(watch, beats, watchdog_timeout=EngineArgs().watchdog_timeout).start()

    def send(msg: Any) -> None:
        t = time.perf_counter()
        to_detok.send(codec_detok.encode(msg))
        sends.append(time.perf_counter() - t)

    to_tm.send(Codec(ToTokenizerManager).encode(
        Ready(who="scheduler", info={"context_length": 8192, "vocab_size": tokenizer.vocab_size})))  # fmt: skip
    from phloem.runtime.sampling.stop import FinishReason
    from phloem.runtime.scheduler.output import OutputCollector

    collector = OutputCollector(send)
    running: list[tuple[Any, list[int]]] = []
    n_reqs = 0
    while True:
        watch.stamp()
        timeout = 0 if running else 200
        while inp.poll(timeout):
            timeout = 0
            for frame in inp.recv_multipart():  # the requests of one turn of the manager's loop
                msg = codec_in.decode(frame)
                if isinstance(msg, ShutdownReq):
                    to_detok.send(codec_detok.encode(ShutdownReq()))
                    with open(stats_path, "w") as f:
                        json.dump({"send_s": sends}, f)
                    return
                if isinstance(msg, TokenizedGenerateReq):
                    max_new = msg.sampling_params.max_new_tokens
                    req = make_req(msg.rid, stream=msg.stream, max_new=max_new)
                    running.append((req, token_stream(tokenizer, max_new, 7 * n_reqs)))
                    n_reqs += 1
        if not running:
            if os.getppid() != parent_pid:
                return
            continue
        t_end = time.perf_counter() + step_s
        for req, ids in running:
            req.output_ids.append(ids[len(req.output_ids)])
            if len(req.output_ids) >= req.params.max_new_tokens:
                req.finish(FinishReason.length(len(req.output_ids)))
            collector.add(req)
        collector.flush()
        running = [(r, ids) for r, ids in running if not r.finished]
        wait = t_end - time.perf_counter()
        if wait > 0:
            time.sleep(wait)  # the forward pass this step stands for (the GPU works, the CPU rests)


def run_pipeline(*, batches: list[int], tokens: int, step_s: float, repeats: int) -> list[dict[str, Any]]:
    import multiprocessing as mp
    import tempfile

    import phloem.runtime.engine as engine_mod
    from phloem.runtime.ipc import IpcPaths
    from phloem.runtime.launch import EngineProcesses, _watchdog
    from phloem.runtime.tokenizer.detokenizer_process import run_detokenizer_process
    from phloem.runtime.tokenizer.manager import TokenizerManager

    stats_path = tempfile.mktemp(suffix=".json")

    async def fake_launch(args: Any) -> tuple[TokenizerManager, EngineProcesses]:
        from phloem.runtime.model_files import resolve_model

        source = resolve_model(None)
        tokenizer = load_default_tokenizer()
        ipc, me, ctx = IpcPaths.fresh(), os.getpid(), mp.get_context("spawn")
        procs = EngineProcesses(ipc=ipc, procs=[
            ctx.Process(target=fake_scheduler_process, args=(ipc, me, step_s, stats_path), daemon=True),
            ctx.Process(target=run_detokenizer_process, args=(source, ipc, me, "warning"), daemon=True),
        ])  # fmt: skip
        for p in procs.procs:
            p.start()
        tm = TokenizerManager(
            args,
            tokenizer=tokenizer,
            ipc=ipc,
            model_info={"context_length": 8192, "vocab_size": tokenizer.vocab_size},
        )
        tm.context_len, tm.vocab_size = 1 << 30, tokenizer.vocab_size
        await tm.start(children_alive=procs.all_alive)
        tm.context_len = int(tm.scheduler_info["context_length"])
        tm._tasks.append(asyncio.create_task(_watchdog(tm, procs)))  # a dead child fails the run
        return tm, procs

    engine_mod.launch_engine = fake_launch  # type: ignore[assignment]
    engine = engine_mod.Engine(log_level="warning")
    results = []
    try:
        engine.generate(input_ids=[[1, 2, 3]] * 2, sampling_params={"max_new_tokens": 8})  # warm up
        for bs in batches:
            ids = [[10 + i, 20, 30] for i in range(bs)]
            params = {"max_new_tokens": tokens}
            for stream in (False, True):
                walls = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    if stream:
                        for _chunk in engine.generate(input_ids=ids, sampling_params=params, stream=True):
                            pass
                    else:
                        engine.generate(input_ids=ids, sampling_params=params)
                    walls.append(time.perf_counter() - t)
                wall = statistics.median(walls)
                floor = tokens * step_s
                results.append({
                    "batch": bs, "stream": stream, "tokens_per_req": tokens, "step_ms": 1e3 * step_s,
                    "call_ms_median": 1e3 * wall, "call_ms_floor": 1e3 * floor,
                    "overhead_ms_per_call": 1e3 * (wall - floor), "tok_s": bs * tokens / wall,
                })  # fmt: skip
            # round trip of a one-token request: the fixed cost of a generate() call
        lat = []
        for _ in range(20):
            t = time.perf_counter()
            engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})
            lat.append(time.perf_counter() - t)
        results.append({"one_token_call_ms_median": 1e3 * statistics.median(lat), "min": 1e3 * min(lat)})
    finally:
        engine.shutdown()
    try:
        with open(stats_path) as f:
            sends = sorted(json.load(f)["send_s"])
        os.unlink(stats_path)
        results.append({
            "scheduler_sends": len(sends), "send_us_median": 1e6 * sends[len(sends) // 2],
            "send_us_p99": 1e6 * sends[int(0.99 * (len(sends) - 1))], "send_us_max": 1e6 * sends[-1],
        })  # fmt: skip
    except FileNotFoundError:
        pass
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("stages", "pipeline", "both"), default="both")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--step-ms", type=float, default=0.0, help="pipeline: emulated forward time per step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    out: dict[str, Any] = {}
    if args.part in ("stages", "both"):
        tokenizer = load_default_tokenizer()
        out["stages"] = [
            stage_costs(tokenizer, batch=bs, tokens=args.tokens, stream=stream)
            for bs in args.batch
            for stream in (True, False)
        ]
        for r in out["stages"]:
            costs = "  ".join(f"{k} {v:7.1f}" for k, v in r["us_per_message"].items())
            print(f"stages bs={r['batch']:<3} stream={r['stream']!s:<5} msgs={r['messages']:<4} us/msg: {costs}"
                  f"  ok={r['texts_match_full_decode']}")  # fmt: skip
    if args.part in ("pipeline", "both"):
        out["pipeline"] = run_pipeline(
            batches=args.batch, tokens=args.tokens, step_s=args.step_ms / 1e3, repeats=args.repeats
        )
        for r in out["pipeline"]:
            print(
                "pipeline", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
