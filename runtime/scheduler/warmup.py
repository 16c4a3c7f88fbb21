"""Start-up warm-up: synthetic requests through the scheduler before it reports ready.

Why: on CUDA the first passes of each kind pay one-off costs that later passes do not:

- Triton compiles (or loads from its disk cache) one binary per specialization of each kernel:
  integer arguments are specialized on being 1 or divisible by 16, so one sequence and many, or
  a token count of 16,384 and one of 16,389, are different binaries;
- the caching allocator grows to a full prefill pass's activations (``cudaMalloc`` per block);
- lazily loaded CUDA modules (cuBLAS, torch's sampling kernels) load on first launch.

Without a warm-up the first requests a server takes pay for all of them, mostly in time to
first token (``docs/benchmarks.md`` has the figures). It costs seconds of start-up, more with
the grammar request below (the kernel builds it moves would be paid anyway).

The requests are random token ids (the model never sees text here) in three waves, each run to
completion before the next:

1. one short prompt (one sequence, odd length), with logprobs: batch-1 prefill and decode; with
   a grammar backend, also a JSON-schema request: it builds the backend (seconds) before ready,
   which the first constrained request would otherwise wait for;
2. ragged prompts that fill one prefill pass and spill into a second, so one of them is chunked,
   with greedy, top-k/top-p and penalized sampling rows: the largest pass the engine will run;
3. half of wave 2's prompts again, cut short and extended with new tokens: passes that extend
   a prefix found in the radix cache.

Outputs go nowhere. Afterwards the cache is flushed, the scheduler's counters and the sampler's
generator are reset, so the engine starts as if the warm-up had not run, with its kernels built
and its memory grown.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import StopChecker
from phloem.runtime.scheduler.req import Req

logger = logging.getLogger("phloem.scheduler")

DEADLINE_S = 300.0  # a warm-up that has not finished by then is stuck: abort it
WARMUP_SCHEMA = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'


@dataclass(frozen=True)
class WarmupRequest:
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0


@dataclass(frozen=True)
class WarmupLimits:
    """What bounds the warm-up's requests: the engine's own limits."""

    vocab_size: int
    context_len: int
    pool_tokens: int  # KV pool size
    max_running: int
    max_prefill_tokens: int
    chunked_prefill_size: int | None
    decode_steps: int = 1  # continuous decode steps per launch
    grammar: bool = False  # a grammar backend is on


def use_warmup(mode: str, device_type: str, *, storage_tier: bool = False) -> bool:
    """``--warmup auto`` runs it on CUDA only: the CPU has no kernels to compile, and its first
    passes cost no more than later ones. Never with a storage tier below the host cache: the
    warm-up's random prompts would be written to the user's storage, which a flush does not
    clear."""
    if storage_tier or mode == "off":
        return False
    return mode == "on" or device_type == "cuda"


def plan_warmup(limits: WarmupLimits, *, seed: int = 0) -> list[list[WarmupRequest]]:
    """The three waves described in the module docstring, sized to ``limits``."""
    rng = random.Random(seed)
    # two decode launches of the continuous length, plus the prefill's token
    max_new = 2 * max(limits.decode_steps, 1) + 1
    longest = limits.context_len - max_new - 1
    # a quarter of the pool keeps every wave far from retraction, whatever else is configured
    budget = min(limits.max_prefill_tokens, limits.chunked_prefill_size or limits.max_prefill_tokens)
    budget = min(budget, limits.pool_tokens // 4)
    if longest < 1 or budget < 2:
        return []

    def ids(n: int) -> list[int]:
        return [rng.randrange(limits.vocab_size) for _ in range(n)]

    greedy = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    sampled = (
        greedy,
        SamplingParams(max_new_tokens=max_new, temperature=0.7, top_p=0.9, top_k=40, ignore_eos=True),
        SamplingParams(
            max_new_tokens=max_new, temperature=1.0, min_p=0.05, repetition_penalty=1.1,
            frequency_penalty=0.2, ignore_eos=True, sampling_seed=seed,
        ),
    )  # fmt: skip

    first = [WarmupRequest(ids(min(5, longest, budget)), greedy, return_logprob=True, top_logprobs_num=2)]
    if limits.grammar:
        constrained = SamplingParams(max_new_tokens=max_new, temperature=0.0, json_schema=WARMUP_SCHEMA)
        first.append(WarmupRequest(ids(min(7, longest, budget)), constrained))

    # Ragged lengths whose sum passes the budget by a quarter: the pass that hits the budget
    # chunks its last prompt, whose rest runs in the next pass with the leftovers.
    lo, hi = max(budget // 16, 1), max(min(budget // 4, longest), 1)
    lengths: list[int] = []
    while sum(lengths) < budget + budget // 4 and len(lengths) < max(limits.max_running - 1, 1):
        lengths.append(rng.randint(min(lo, hi), hi))
    full = [WarmupRequest(ids(n), sampled[i % len(sampled)]) for i, n in enumerate(lengths)]

    extended = []
    for i, r in enumerate(full[::2]):
        keep = max(len(r.input_ids) * 3 // 4, 1)
        prompt = r.input_ids[:keep] + ids(min(37, longest - keep))
        extended.append(WarmupRequest(prompt[:longest], sampled[i % len(sampled)]))
    return [w for w in (first, full, extended) if w]


def run_warmup(scheduler: Any, runtime: Any, waves: list[list[WarmupRequest]]) -> dict[str, float]:
    """Run ``waves`` through ``scheduler`` (idle, fresh), then put it back as it was.

    Returns a summary for the start-up log and the engine's info. Raises if the scheduler is not
    idle, if a wave does not finish, or if a warm-up request was aborted: any of these would also
    hit the first real requests, and a server that cannot serve should not report ready.
    """
    if not scheduler.is_idle:
        raise RuntimeError("warm-up needs an idle scheduler")
    t0 = time.perf_counter()
    deadline = time.monotonic() + DEADLINE_S
    send = scheduler.outputs._send
    scheduler.outputs._send = lambda batch: None  # nobody asked for these outputs
    steps = prompt_tokens = 0
    reqs: list[Req] = []
    try:
        for w, wave in enumerate(waves):
            for i, r in enumerate(wave):
                req = _req(f"warmup-{w}-{i}", r, runtime)
                reqs.append(req)
                prompt_tokens += len(r.input_ids)
                scheduler.add_request(req)
            while not scheduler.is_idle:
                if scheduler.step():
                    steps += 1
                else:
                    time.sleep(0.001)  # a grammar still compiling on its thread
                if time.monotonic() > deadline:
                    scheduler.abort(None, abort_all=True, message="warm-up did not finish")
                    scheduler.drain()
                    raise RuntimeError(f"warm-up did not finish in {DEADLINE_S:.0f} s")
            scheduler.drain()
    finally:
        scheduler.outputs._send = send
    aborted = [r for r in reqs if r.finished_reason is not None and r.finished_reason.kind == "abort"]
    for r in [r for r in aborted if r.params.grammar is not None]:
        # a grammar backend that cannot be built fails constrained requests only, and the engine
        # still serves the rest (grammar_queue.py): so it does here
        logger.warning("warm-up: the constrained request failed: %s", r.finished_reason.message)
        aborted.remove(r)
    if aborted:
        raise RuntimeError(f"warm-up request {aborted[0].rid} was aborted: {aborted[0].finished_reason}")
    if not scheduler.flush_cache():
        raise RuntimeError("warm-up left KV cache slots held")
    runtime.cache.check_integrity()
    scheduler.reset_counters()
    reset = getattr(runtime.runner.sampler, "reset", None)
    if reset is not None:
        reset()
    return {
        "warmup_requests": len(reqs),
        "warmup_prompt_tokens": prompt_tokens,
        "warmup_steps": steps,
        "warmup_s": round(time.perf_counter() - t0, 3),
    }


def _req(rid: str, r: WarmupRequest, runtime: Any) -> Req:
    return Req(
        rid=rid,
        origin_input_ids=list(r.input_ids),
        params=r.params,
        stop_checker=StopChecker(r.params, eos_token_ids=runtime.eos_token_ids, tokenizer=runtime.tokenizer),
        return_logprob=r.return_logprob,
        top_logprobs_num=r.top_logprobs_num,
    )


def warm_up_scheduler(args: Any, scheduler: Any, runtime: Any) -> None:
    """``--warmup``: run the warm-up if it applies, and log and record its summary."""
    device = runtime.runner.device.type
    if not use_warmup(args.warmup, device, storage_tier=bool(args.hicache_storage_backend)):
        return
    cfg = scheduler.cfg
    limits = WarmupLimits(
        vocab_size=runtime.runner.vocab_size,
        context_len=runtime.info["context_length"],
        pool_tokens=runtime.info["max_total_num_tokens"],
        max_running=cfg.max_running_requests,
        max_prefill_tokens=cfg.max_prefill_tokens,
        chunked_prefill_size=cfg.chunked_prefill_size,
        decode_steps=cfg.decode_steps,
        grammar=scheduler.grammar is not None,
    )
    summary = run_warmup(scheduler, runtime, plan_warmup(limits, seed=args.random_seed))
    runtime.info.update(summary)
    logger.info(
        "warm-up: %d requests, %d prompt tokens, %d scheduler steps in %.2f s",
        summary["warmup_requests"], summary["warmup_prompt_tokens"], summary["warmup_steps"], summary["warmup_s"],
    )  # fmt: skip
