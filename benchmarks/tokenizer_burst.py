"""A burst of long prompts through the tokenizer manager: how soon they reach the scheduler, and
how long the manager's event loop stalls meanwhile (while it stalls, no stream gets a token).

    python -m phloem.bench.tokenizer_burst [--num-prompts 256] [--prompt-tokens 540] [--out F]

An in-process Engine on the default model. Each round submits every prompt at once (one token
each) and records when each request is sent to the scheduler; once all are sent it aborts them,
so the model's prefill does not enter the figures. A ticker on the manager's loop sleeps 1 ms at
a time and records how late it wakes. ``--inline`` encodes every prompt on the loop, as the
manager did before its batch encoder (the A side of an A/B).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from typing import Any

from phloem.bench.compare import git_state
from phloem.bench.report import emit_json


async def _round(eng: Any, texts: list[str]) -> dict[str, float]:
    tm = eng.tm
    sends: list[float] = []
    all_sent = asyncio.Event()
    caller = asyncio.get_running_loop()
    original = tm._send

    def record(msg: Any) -> None:
        if type(msg).__name__ == "TokenizedGenerateReq":
            sends.append(time.perf_counter())
            if len(sends) == len(texts):
                caller.call_soon_threadsafe(all_sent.set)
        original(msg)

    lags: list[float] = []
    ticking = True

    async def ticker() -> None:
        while ticking:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    tm._send = record
    tick = asyncio.run_coroutine_threadsafe(ticker(), eng._loop)
    try:
        start = time.perf_counter()
        jobs = [
            asyncio.ensure_future(
                eng.async_generate(t, sampling_params={"max_new_tokens": 1, "ignore_eos": True})
            )
            for t in texts
        ]
        await asyncio.wait_for(all_sent.wait(), timeout=120)
        eng._loop.call_soon_threadsafe(lambda: tm.abort(abort_all=True))
        await asyncio.gather(*jobs, return_exceptions=True)
    finally:
        ticking = False
        tm._send = original
        tick.result(timeout=10)
    lags.sort()
    return {
        "first_send_ms": (sends[0] - start) * 1e3,
        "quarter_sent_ms": (sends[len(sends) // 4 - 1] - start) * 1e3,
        "all_sent_ms": (sends[-1] - start) * 1e3,
        "loop_lag_max_ms": lags[-1] * 1e3,
        "loop_lag_p99_ms": lags[int(0.99 * (len(lags) - 1))] * 1e3,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=540)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--inline", action="store_true", help="encode every prompt on the loop (the old manager)")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from phloem.runtime.engine import Engine

    eng = Engine(log_level="warning")
    try:
        if args.inline:
            eng.tm._encoder.inline_chars = 1 << 62
        tok = eng.tm.tokenizer
        rng = random.Random(0)
        texts = [
            tok.decode([rng.randrange(100, tok.vocab_size - 100) for _ in range(args.prompt_tokens)])
            for _ in range(args.num_prompts)
        ]
        rounds = [asyncio.run(_round(eng, texts)) for _ in range(args.rounds)]
    finally:
        eng.shutdown()
    med = {k: round(statistics.median(r[k] for r in rounds), 1) for k in rounds[0]}
    result = {
        "benchmark": "tokenizer_burst",
        "command": "python -m phloem.bench.tokenizer_burst " + " ".join(sys.argv[1:]),
        **git_state(),
        "encoder": "inline on the loop" if args.inline else "batch encoder",
        "num_prompts": args.num_prompts,
        "prompt_tokens": args.prompt_tokens,
        "rounds": [{k: round(v, 1) for k, v in r.items()} for r in rounds],
        "median": med,
    }
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
