"""Where a scheduler step's time goes: the real Scheduler, in this process, on the GPU.

    source benchmarks/gpu/setup_h200.sh install
    python3 benchmarks/gpu/step_profile.py --batch 256 --out $OUT/step_b256.json          # plain, overlap on
    python3 benchmarks/gpu/step_profile.py --batch 1 --spec EAGLE --out $OUT/spec_b1.json  # speculative

The Scheduler and its collaborators are built exactly as the scheduler process builds them
(``build_scheduler``), then driven by ``step()`` here, so one profile covers the scheduler's host
work, the worker, the model and (with ``--spec``) drafting and verification. Three runs over the
same window: decode only (every request admitted and prefilled first), or with ``--window prefill``
the prefill of the whole batch (every request admitted at once, stepped until each has its first
token). ``--min-input-len`` draws ragged prompt lengths, as in the offline workload:

- timing: wall and CPU time (``time.thread_time`` of the scheduler thread) per ``step()``;
- ``cProfile``: the host functions with the most cumulative time (``--cprofile``);
- ``torch.profiler``: kernels by CUDA time and the GPU busy fraction over the window (the union
  of kernel, memcpy and memset intervals over the window's span), from the Chrome trace.

Writes one JSON file (``--out``) with the figures and the top tables.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import faulthandler
import gc
import gzip
import io
import json
import os
import pstats
import random
import shutil
import time
from typing import Any


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    from phloem.runtime.config import EngineArgs
    from phloem.runtime.scheduler.builder import build_scheduler

    kw: dict[str, Any] = {
        "model_path": args.model,
        "load_format": args.load_format,
        "dummy_shape": args.dummy_shape,
        "tokenizer_path": args.tokenizer_path,
        "device": args.device,
        "dtype": args.dtype,
        "disable_overlap_schedule": args.no_overlap,
        "enable_cpu_overlap_schedule": args.cpu_overlap,
        "disable_cuda_graph": args.no_cuda_graph,
        "max_running_requests": max(args.batch, 1),
        "num_continuous_decode_steps": args.decode_steps,
        "kv_cache_dtype": args.kv_cache_dtype,
        "grammar_on_device": args.grammar_on_device,
        "enable_jump_forward": args.jump_forward,
    }
    if args.spec:
        kw.update(
            speculative_algorithm=args.spec,
            speculative_num_steps=args.spec_steps,
            speculative_eagle_topk=args.spec_topk,
            speculative_num_draft_tokens=args.spec_draft_tokens,
        )
    if args.head:
        kw["speculative_draft_model_path"] = args.head
    engine_args = EngineArgs(**kw)
    sched, runtime = build_scheduler(engine_args, send=lambda m: None)
    if not args.no_server_warmup:  # the warm-up a server runs before Ready (CUDA only)
        from phloem.runtime.scheduler.warmup import warm_up_scheduler

        warm_up_scheduler(engine_args, sched, runtime)
    if args.no_sync_near_end:  # A/B of processing at once a batch whose rows may all end
        sched.cfg = dataclasses.replace(sched.cfg, sync_near_end=False)
    if args.no_grammar_cap:  # A/B of launching no step past a grammar's longest way to its end
        sched.cfg = dataclasses.replace(sched.cfg, cap_at_grammar_end=False)
    if args.no_draft_ahead and sched.spec is not None:
        sched.spec.draft_ahead = False  # A/B of drafting the next trees right after the catch-up
    if hasattr(sched.worker, "_thread"):  # the overlap loop's forward thread
        sched._worker_clock = WorkerClock(sched.worker)
    if not args.no_gc_freeze:  # as the scheduler's process does after start-up
        from phloem.runtime.scheduler.process import freeze_startup_heap

        freeze_startup_heap()
    return sched, runtime


class GcPauses:
    """The cyclic collector's pauses inside a window (``gc.callbacks``), from either thread: a full
    collection stalls every running row for its whole length."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._started: list[float] = []
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started.append(time.perf_counter())
        elif self._started:
            self.pauses.append((info["generation"], time.perf_counter() - self._started.pop()))

    def since(self, mark: int) -> dict[str, Any]:
        window = self.pauses[mark:]
        return {
            "gc_pause_ms_max": round(1e3 * max((sec for _, sec in window), default=0.0), 2),
            "gc_full_collections": sum(gen == 2 for gen, _ in window),
            "gc_pause_ms_total": round(1e3 * sum(sec for _, sec in window), 2),
        }


GC = GcPauses()


class StallDump:
    """With ``--stall-dump MS``: every thread's Python stack, written to a file when one step runs
    past MS milliseconds (``faulthandler``), to name what a rare long step was doing."""

    file: Any = None
    seconds = 0.0

    @classmethod
    def arm(cls) -> None:
        if cls.file is not None:
            faulthandler.dump_traceback_later(cls.seconds, file=cls.file)

    @classmethod
    def disarm(cls) -> None:
        if cls.file is not None:
            faulthandler.cancel_dump_traceback_later()


# A schema whose strings never force an end: the constrained rows run their full length.
NOTE_SCHEMA = '{"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}'
# A regex of unbounded length: words until a period.
WORDS_REGEX = r"[A-Za-z][A-Za-z ,]*\."
# A schema whose long keys are forced text (jump-forward's case); every value is bounded, so a
# record ends with or without jump-forward and the two are compared over whole records.
KEYS_SCHEMA = (
    '{"type": "object", "properties": {'
    '"customer_identification_code": {"type": "string", "maxLength": 6}, '
    '"preferred_delivery_address_line": {"type": "string", "maxLength": 12}, '
    '"subscription_renewal_is_automatic": {"type": "boolean"}, '
    '"preferred_contact_channel_for_updates": {"enum": ["email", "phone", "post"]}}, '
    '"required": ["customer_identification_code", "preferred_delivery_address_line", '
    '"subscription_renewal_is_automatic", "preferred_contact_channel_for_updates"], '
    '"additionalProperties": false}'
)
# An everyday extraction schema: strings, numbers, an enum, a list, a nested object.
RECORD_SCHEMA = (
    '{"type": "object", "properties": {'
    '"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}, '
    '"email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,10}\\\\.com$"}, '
    '"role": {"enum": ["admin", "editor", "viewer"]}, '
    '"tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4}, '
    '"address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, '
    '"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}}, '
    '"required": ["name", "age", "email", "role", "tags", "address"]}'
)
GRAMMARS = {
    "none": {},
    "json-schema": {"json_schema": NOTE_SCHEMA},
    "regex": {"regex": WORDS_REGEX},
    "keys": {"json_schema": KEYS_SCHEMA},
    "record": {"json_schema": RECORD_SCHEMA},
    # the serving benchmark's json-schema dataset at 128 output tokens (an array of 20+ records)
    "records": {"json_schema": json.dumps({"type": "array", "minItems": 20, "items": {
        "type": "object", "required": ["name", "city", "year"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
                       "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
                       "year": {"type": "integer"}}}})},
}


def make_reqs(
    rt: Any, batch: int, input_len: int, max_new: int, tag: str, grammar: str = "none", min_len: int = 0
) -> list[Any]:
    """``batch`` greedy requests; prompts of ``input_len`` tokens, or with ``min_len`` lengths drawn
    uniformly from ``[min_len, input_len]`` (seeded: the same lengths in every window).
    ``grammar``: a key of ``GRAMMARS`` for every row, or ``mixed`` (even rows the JSON schema, odd
    rows free)."""
    from phloem.runtime.sampling.params import SamplingParams
    from phloem.runtime.sampling.stop import StopChecker
    from phloem.runtime.scheduler.req import Req
    from phloem.training.eagle_head import DEFAULT_PROMPTS, read_prompts

    prompts = read_prompts(DEFAULT_PROMPTS)
    vocab = rt.runner.vocab_size
    lengths = random.Random(0).choices(range(min_len, input_len + 1), k=batch) if min_len else None
    reqs = []
    for i in range(batch):
        text = rt.tokenizer.apply_chat_template([{"role": "user", "content": prompts[i % len(prompts)]}])
        ids = [t % vocab for t in rt.tokenizer.encode(text)]  # a tiny test shape has a small vocab
        want = lengths[i] if lengths else input_len
        if want:
            ids = (ids * (want // max(len(ids), 1) + 1))[:want]
        kind = ("json-schema" if i % 2 == 0 else "none") if grammar == "mixed" else grammar
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **GRAMMARS[kind])
        reqs.append(Req(rid=f"{tag}{i}", origin_input_ids=ids, params=params,
                        stop_checker=StopChecker(params, eos_token_ids=rt.eos_token_ids)))  # fmt: skip
    return reqs


def free_twins(rt: Any, reqs: list[Any], like: list[Any]) -> list[Any]:
    """``reqs`` without their grammar, each limited to the output length of its twin in ``like``
    (the unconstrained side of a comparison at equal input and output lengths)."""
    import msgspec
    from phloem.runtime.sampling.stop import StopChecker

    for req, twin in zip(reqs, like):
        req.params = msgspec.structs.replace(
            req.params, json_schema=None, regex=None, max_new_tokens=max(1, len(twin.output_ids))
        )
        req.stop_checker = StopChecker(req.params, eos_token_ids=rt.eos_token_ids)
    return reqs


def prefill_all(s: Any, reqs: list[Any]) -> None:
    for r in reqs:
        s.add_request(r)
    while any(not r.output_ids for r in reqs):
        if not s.step():
            time.sleep(0.001)  # grammars compiling: leave their threads the interpreter


def drive_prefill(s: Any, reqs: list[Any]) -> dict[str, Any]:
    """Admit every request and step until each has its first token: the prefill window."""
    for r in reqs:
        s.add_request(r)
    t0 = time.perf_counter()
    steps = 0
    while any(not r.output_ids for r in reqs):
        s.step()
        steps += 1
    total = time.perf_counter() - t0
    tokens = sum(len(r.origin_input_ids) for r in reqs)
    return {"steps": steps, "seconds": total, "prompt_tokens": tokens, "prompt_tok_s": tokens / total}


def drive_requests(s: Any, reqs: list[Any], tokenizer: Any) -> dict[str, Any]:
    """Admit every request and step until each finished: whole requests, prefill included. Counts
    the output's characters too: jump-forward writes forced text in the tokenizer's own spelling,
    which can take fewer tokens than the model would pick, so tokens/s alone would undersell it."""
    jumped, stale, passes = s.stats.jump_forward_tokens, s.stats.jump_stale_tokens, _extend_passes(s)
    chained = s.stats.chain_forced_tokens
    skipped, syncs = _skipped_steps(s), _near_end_syncs(s)
    clock = getattr(s, "_worker_clock", None)
    worker_start = clock.seconds if clock is not None else 0.0
    gc_mark = len(GC.pauses)
    for r in reqs:
        s.add_request(r)
    trace = StepTrace(s) if STEP_TRACE else None
    t0, c0 = time.perf_counter(), time.thread_time()
    steps = 0
    while not all(r.finished for r in reqs):
        StallDump.arm()
        s.step()
        StallDump.disarm()
        if trace is not None:
            trace.stepped()
        steps += 1
    s.drain()
    if trace is not None:
        trace.close()
    total, host = time.perf_counter() - t0, time.thread_time() - c0
    tokens = sum(len(r.output_ids) for r in reqs)
    chars = sum(len(tokenizer.decode(r.output_ids)) for r in reqs)
    kinds = [r.finished_reason.kind for r in reqs if getattr(r, "finished_reason", None) is not None]
    return {
        "steps": steps, "seconds": total, "decode_tokens": tokens, "tok_s": tokens / total,
        "chars": chars, "chars_per_s": chars / total, "requests_per_s": len(reqs) / total,
        "jump_forward_tokens": s.stats.jump_forward_tokens - jumped,
        "jump_stale_tokens": s.stats.jump_stale_tokens - stale,  # in flight at a jump, thrown away
        "chain_forced_tokens": s.stats.chain_forced_tokens - chained,  # taken by chain launches
        "extend_graph_passes": _extend_passes(s) - passes,  # jumps' extends replayed from graphs
        "skipped_steps": _skipped_steps(s) - skipped,  # early exit: forwards not run after every stop
        "near_end_syncs": _near_end_syncs(s) - syncs,  # batches processed at once near their end
        # the device time of a decode step measured at the window's end (sets a launch's steps)
        "pace_step_ms": (getattr(getattr(s, "pace", None), "per_step", None) or 0.0) * 1e3,
        "tokens_per_step": tokens / max(steps, 1),
        # CPU seconds of the scheduler thread (its own work, not its waits) and the forward's
        "host_cpu_s": host,
        "worker_cpu_s": clock.seconds - worker_start if clock is not None else None,
        "grammar_rejected": sum(kind == "abort" for kind in kinds),  # must be 0
        "finish_kinds": sorted(set(kinds)),
        **GC.since(gc_mark),
        **({"step_trace": trace.rows} if trace is not None else {}),
    }  # fmt: skip


STEP_TRACE = False  # --step-trace


class StepTrace:
    """With ``--step-trace``: one row per ``step()`` of a request window, what it launched and how
    long the step took: ``[wall_ms, kind, rows, decode_steps, longest_extend, extend_tokens,
    graph]`` (kind ``D`` decode, ``E`` extend, ``-`` nothing launched; ``graph``: a short extend
    graph was replayed during the step, which with overlap is the step after the extend's). A
    step's wall holds the processing of the step before it with overlap, and its own without."""

    def __init__(self, s: Any) -> None:
        self.s = s
        self.rows: list[list[Any]] = []
        self.launched: list[Any] = []
        self.passes = _extend_passes(s)
        self.t = time.perf_counter()
        launch = s.launch

        def traced(batch: Any, vocab_mask: Any = None) -> Any:
            lens = list(batch.extend_lens)
            self.launched = ["E" if batch.is_prefill else "D", len(batch.reqs), batch.decode_steps,
                             max(lens, default=0), sum(lens)]  # fmt: skip
            return launch(batch, vocab_mask)

        s.launch = traced

    def stepped(self) -> None:
        now, passes = time.perf_counter(), _extend_passes(self.s)
        launched = self.launched or ["-", 0, 0, 0, 0]
        self.rows.append([round(1e3 * (now - self.t), 3), *launched, passes > self.passes])
        self.t, self.passes, self.launched = now, passes, []

    def close(self) -> None:
        del self.s.launch  # the class's method again


def _skipped_steps(s: Any) -> int:
    """Continuous decode steps whose forward the decode graphs skipped (early exit), read without
    waiting: exact after a drain; a launch in flight when a window starts counts in that window."""
    count = getattr(s, "decode_steps_skipped", None)
    return count() if count is not None else 0


def _near_end_syncs(s: Any) -> int:
    return getattr(getattr(s, "stats", None), "near_end_syncs", 0)


def _extend_passes(s: Any) -> int:
    graphs = getattr(getattr(s.worker, "runner", None), "extend_graphs", None)
    return graphs.passes if graphs is not None else 0


def finish(s: Any, reqs: list[Any]) -> None:
    while not all(r.finished for r in reqs):
        s.step()
    s.drain()


class WorkerClock:
    """CPU seconds the forward worker's thread spends in its steps (``time.thread_time`` in that
    thread), and optionally a cProfile of them: the overlap loop's second thread, which shares
    the GIL with the scheduler's."""

    def __init__(self, worker: Any) -> None:
        self.seconds = 0.0
        self.profile: cProfile.Profile | None = None
        run = worker._run

        def timed(*a: Any, **kw: Any) -> Any:
            prof = self.profile
            c = time.thread_time()
            if prof is not None:
                prof.enable()
            try:
                return run(*a, **kw)
            finally:
                if prof is not None:
                    prof.disable()
                self.seconds += time.thread_time() - c

        worker._run = timed


def drive(s: Any, reqs: list[Any], hook: Any = None) -> dict[str, Any]:
    """Step until every request finished; per-step wall and CPU seconds (scheduler thread, and
    the forward worker's thread when it runs one)."""
    walls, cpus, per_token = [], [], []
    clock = getattr(s, "_worker_clock", None)
    worker_start = clock.seconds if clock is not None else 0.0
    start_tokens = done = sum(len(r.output_ids) for r in reqs)
    skipped, syncs = _skipped_steps(s), _near_end_syncs(s)
    gc_mark = len(GC.pauses)
    t0 = time.perf_counter()
    while not all(r.finished for r in reqs):
        w, c = time.perf_counter(), time.thread_time()
        StallDump.arm()
        s.step()
        StallDump.disarm()
        cpus.append(time.thread_time() - c)
        walls.append(time.perf_counter() - w)
        now = sum(len(r.output_ids) for r in reqs)  # outside the timed step
        if now > done:  # a step's wall over the tokens per request it delivered
            per_token.append(walls[-1] * len(reqs) / (now - done))
        done = now
        if hook is not None:
            hook()
    s.drain()
    total = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in reqs) - start_tokens
    kinds = [r.finished_reason.kind for r in reqs if getattr(r, "finished_reason", None) is not None]
    in_order = [round(1e3 * w, 3) for w in walls]
    walls.sort()
    per_token.sort()
    return {
        "steps": len(walls),
        "seconds": total,
        "decode_tokens": tokens,
        "tok_s": tokens / total,
        "step_wall_ms_mean": 1e3 * sum(walls) / len(walls),
        "step_wall_ms_median": 1e3 * walls[len(walls) // 2],
        "step_cpu_ms_mean": 1e3 * sum(cpus) / len(cpus),
        "worker_cpu_ms_mean": 1e3 * (clock.seconds - worker_start) / len(walls)
        if clock is not None
        else None,
        "tokens_per_step": tokens / len(walls),
        "skipped_steps": _skipped_steps(s) - skipped,  # early exit: forwards not run after every stop
        "near_end_syncs": _near_end_syncs(s) - syncs,  # batches processed at once near their end
        # rows the host's grammar check ended (a token the mask should not have allowed): must be 0
        "grammar_rejected": sum(kind == "abort" for kind in kinds),
        "finish_kinds": sorted(set(kinds)),
        # per decode step, comparable across launch shapes (a launch of K steps counts K times)
        "decode_step_ms_median": 1e3 * per_token[len(per_token) // 2] if per_token else None,
        "step_wall_ms": in_order,
        **GC.since(gc_mark),
    }


def merged(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """One window's figures from several timed windows of the same requests (``--repeats``):
    the first window's fields, with rates over the total time and the counts summed; each
    window's tok/s in ``repeat_tok_s``."""
    if len(windows) == 1:
        return windows[0]
    out = dict(windows[0])
    seconds = sum(w["seconds"] for w in windows)
    for key in ("seconds", "decode_tokens", "steps", "chars", "skipped_steps", "jump_forward_tokens",
                "jump_stale_tokens", "chain_forced_tokens", "extend_graph_passes", "grammar_rejected",
                "near_end_syncs",
                "gc_full_collections", "gc_pause_ms_total"):  # fmt: skip
        if key in out:
            out[key] = sum(w[key] for w in windows)
    out["tok_s"] = out["decode_tokens"] / seconds
    out["tokens_per_step"] = out["decode_tokens"] / max(out["steps"], 1)
    if "chars" in out:
        out["chars_per_s"] = out["chars"] / seconds
        out["requests_per_s"] = sum(w["requests_per_s"] * w["seconds"] for w in windows) / seconds
    out["repeat_tok_s"] = [round(w["tok_s"], 1) for w in windows]
    if "gc_pause_ms_max" in out:
        out["gc_pause_ms_max"] = max(w["gc_pause_ms_max"] for w in windows)
    return out


def _captures(s: Any) -> int:
    """CUDA graphs captured on first use so far (EAGLE draft graphs and speculative windows)."""
    spec = s.spec
    if spec is None:
        return 0
    worker = getattr(spec.drafter, "worker", None)
    draft = worker.graphs.captured if worker is not None and worker.graphs is not None else 0
    return draft + (spec.window.captured if spec.window is not None else 0)


def gpu_busy(trace_path: str) -> dict[str, Any]:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not spans:
        return {"gpu_busy_fraction": None}
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    gaps = []
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = spans[-1][1] - spans[0][0]
    gaps.sort()
    return {
        "gpu_busy_fraction": busy / span,
        "gpu_span_ms": span / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "kernels": len(spans),
        "idle_gaps_over_20us": sum(1 for g in gaps if g > 20),
        "largest_gaps_us": gaps[-5:],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dummy-shape", default="smollm2-135m")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=0, help="0: the prompt as tokenized")
    p.add_argument(
        "--min-input-len",
        type=int,
        default=0,
        help="draw prompt lengths uniformly from [this, --input-len] (ragged contexts)",
    )
    p.add_argument("--window", choices=["decode", "prefill", "request"], default="decode",
                   help="what the timed and profiled windows cover (request: admission to last token)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="timed windows of the same requests, merged")
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--cpu-overlap", action="store_true", help="the overlap loop on the CPU too (off there by default)")
    p.add_argument("--decode-steps", type=int, default=0, help="--num-continuous-decode-steps (0: auto)")
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--stall-dump", type=float, default=0.0, metavar="MS",
                   help="write every thread's stack to OUT.stalls.txt when a step runs past MS ms "
                   "(faulthandler reads the other threads' frames unsafely: it can crash the run)")
    p.add_argument("--no-server-warmup", action="store_true",
                   help="skip the synthetic requests a server runs before Ready (kernel compiles then land in windows)")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the start-up heap in the cyclic collector's reach (the server freezes it)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8_e4m3")
    p.add_argument("--spec", default=None, choices=[None, "EAGLE", "NGRAM"])
    p.add_argument("--head", default=None)
    p.add_argument("--spec-steps", type=int, default=3)
    p.add_argument("--spec-topk", type=int, default=1)
    p.add_argument("--spec-draft-tokens", type=int, default=4)
    p.add_argument("--no-sync-near-end", action="store_true",
                   help="keep batches whose rows may all end in flight (SchedulerConfig.sync_near_end)")
    p.add_argument("--no-grammar-cap", action="store_true",
                   help="launch steps past the most tokens a grammar allows "
                        "(SchedulerConfig.cap_at_grammar_end)")
    p.add_argument("--no-draft-ahead", action="store_true", help="EAGLE: draft each step's trees on demand")
    p.add_argument("--json-schema", action="store_true", help="same as --grammar json-schema")
    p.add_argument("--grammar", default="none", choices=[*GRAMMARS, "mixed"],
                   help="constrain every request (mixed: every other one by the JSON schema)")
    p.add_argument("--grammar-on-device", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--jump-forward", action="store_true", help="--enable-jump-forward")
    p.add_argument("--vs-free", action="store_true",
                   help="also time the requests without a grammar at the constrained outputs' lengths")
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--step-trace", action="store_true",
                   help="request windows: what each step launched and its wall time (step_trace)")
    p.add_argument("--no-torch-profile", action="store_true")
    p.add_argument(
        "--keep-trace",
        action="store_true",
        help="keep the Chrome trace next to --out (gzip; read it with trace_gaps.py)",
    )
    p.add_argument(
        "--trace-stacks",
        action="store_true",
        help="record Python stacks in the trace (names the host code; slows the host ~2-4x)",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args()
    global STEP_TRACE
    STEP_TRACE = args.step_trace

    import torch

    s, rt = build(args)
    result: dict[str, Any] = {
        "command": "python3 benchmarks/gpu/step_profile.py " + " ".join(os.sys.argv[1:])
    }

    def reqs_for(tag: str) -> list[Any]:
        grammar = "json-schema" if args.json_schema else args.grammar
        return make_reqs(rt, args.batch, args.input_len, args.max_new_tokens, tag, grammar, args.min_input_len)

    def window(reqs: list[Any]) -> dict[str, Any]:
        """Time the chosen window over fresh requests; the rest of their life runs outside it."""
        if args.window == "prefill":
            timing = drive_prefill(s, reqs)
            finish(s, reqs)
            s.flush_cache()  # each window prefills its prompts from scratch
            return timing
        if args.window == "request":
            timing = drive_requests(s, reqs, rt.tokenizer)
            s.flush_cache()
            return timing
        prefill_all(s, reqs)
        return drive(s, reqs)

    # warm-up: the timed window itself, once, so kernels compiled and graphs captured on first use
    # (EAGLE's draft graphs, per batch and key width) fall outside it
    window(reqs_for("warm"))
    s.flush_cache()  # the timed prompts prefill again (a cached prompt would start EAGLE's draft late)
    if args.stall_dump > 0:  # timed windows only: the warm-up compiles
        StallDump.file = open(os.path.splitext(args.out)[0] + ".stalls.txt", "w")  # noqa: SIM115 (process-long)
        StallDump.seconds = args.stall_dump / 1e3

    graphs = _captures(s)
    timed = [reqs_for(f"t{i}") for i in range(args.repeats)]
    result["timing"] = merged([window(reqs) for reqs in timed])
    if args.vs_free:
        # the same requests without a grammar, each run to the length its constrained twin reached
        window(free_twins(rt, reqs_for("fw"), timed[0]))
        s.flush_cache()
        free = [window(free_twins(rt, reqs_for(f"f{i}"), reqs)) for i, reqs in enumerate(timed)]
        result["free_timing"] = merged(free)
        result["ratio_to_free"] = result["timing"]["tok_s"] / result["free_timing"]["tok_s"]
        print(json.dumps({"free_tok_s": result["free_timing"]["tok_s"], "ratio": result["ratio_to_free"]}))
    if s.spec is not None:
        result["timing"]["accept_length"] = s.spec.mean_accept_length
        result["timing"]["graphs_captured_in_window"] = _captures(s) - graphs
    print(json.dumps(result["timing"]), flush=True)

    if args.cprofile:
        reqs = reqs_for("c")
        prof = cProfile.Profile()
        prof.enable()
        result["cprofile_timing"] = window(reqs)
        prof.disable()
        clock = getattr(s, "_worker_clock", None)
        if clock is not None:  # a window of its own: Python 3.12 runs one profiler at a time
            clock.profile = cProfile.Profile()
            result["cprofile_worker_timing"] = window(reqs_for("w"))
            buf = io.StringIO()
            pstats.Stats(clock.profile, stream=buf).sort_stats("tottime").print_stats(30)
            result["cprofile_worker_tottime"] = buf.getvalue()
            buf = io.StringIO()
            pstats.Stats(clock.profile, stream=buf).sort_stats("cumulative").print_stats(40)
            result["cprofile_worker_cumulative"] = buf.getvalue()
            clock.profile = None
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
        result["cprofile_cumulative"] = buf.getvalue()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        result["cprofile_tottime"] = buf.getvalue()
        print(result["cprofile_tottime"], flush=True)

    if not args.no_torch_profile and args.device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        reqs = reqs_for("p")
        if args.window != "prefill":
            prefill_all(s, reqs)
        torch.cuda.synchronize()
        with profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.trace_stacks
        ) as tp:
            if args.window != "prefill":
                result["profiled_timing"] = drive(s, reqs)
            else:
                result["profiled_timing"] = drive_prefill(s, reqs)
            torch.cuda.synchronize()
        if args.window == "prefill":
            finish(s, reqs)
        trace = os.path.splitext(args.out)[0] + ".trace.json"
        tp.export_chrome_trace(trace)
        result["gpu"] = gpu_busy(trace)
        if args.keep_trace:
            with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.remove(trace)  # large; the figures above are what we keep
        result["top_cuda"] = tp.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        result["top_cpu"] = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(result["gpu"], flush=True)
        print(result["top_cpu"], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
