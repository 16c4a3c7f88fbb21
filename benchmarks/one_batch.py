"""``phloem bench one-batch``: prefill time and per-step decode time of one static batch.

    phloem bench one-batch --batch-size 1,8 --input-len 256 --output-len 16

For each (batch size, input length, output length) the Engine gets ``batch`` prompts at once, each
exactly ``input_len`` tokens (fresh words, cache flushed, so nothing is reused) with ``ignore_eos``
and ``max_new_tokens = output_len``. Prefill time is when the last request of the batch got its
first token; a decode step is the rest of the batch's time over ``output_len - 1`` steps.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from typing import Any

from phloem.bench.client import EngineBackend, Result
from phloem.bench.datasets import DatasetOptions, TextMaker, random_dataset
from phloem.bench.offline import add_engine_args, start_engine
from phloem.bench.report import append_jsonl
from phloem.bench.runner import RunOptions, run_sessions


def int_list(value: str) -> list[int]:
    return [int(x) for x in value.split(",") if x.strip()]


def add_one_batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int_list, default=[1, 8], help="comma-separated list")
    p.add_argument("--input-len", type=int_list, default=[256], help="comma-separated list")
    p.add_argument("--output-len", type=int_list, default=[16], help="comma-separated list")
    p.add_argument("--repeat", type=int, default=1, help="runs per point (the fastest is kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file", default=None, help="append one JSON line per point")
    add_engine_args(p)


def batch_timing(results: list[Result], batch: int, input_len: int, output_len: int) -> dict[str, Any]:
    """Prefill = last first token; decode step = remaining time / (output_len - 1)."""
    prefill = max(r.ttft for r in results)
    total = max(r.latency for r in results)
    step = (total - prefill) / (output_len - 1) if output_len > 1 else 0.0
    return {
        "batch_size": batch,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_s": prefill,
        "prefill_tok_s": batch * input_len / prefill if prefill else 0.0,
        "decode_step_ms": step * 1000,
        "decode_tok_s": batch / step if step else 0.0,
        "total_s": total,
    }


async def one_point(
    engine: Any, maker: TextMaker, batch: int, input_len: int, output_len: int, seed: int
) -> dict[str, Any]:
    opt = DatasetOptions(
        seed=seed, num_prompts=batch, random_input_len=input_len, random_output_len=output_len
    )
    sessions = random_dataset(maker, opt)
    engine.flush_cache()
    results, _ = await run_sessions(
        EngineBackend(engine), sessions, engine.tm.tokenizer, RunOptions(progress=False)
    )
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"one-batch request failed: {failed[0]}")
    return batch_timing(results, batch, input_len, output_len)


async def one_batch_bench(engine: Any, ns: argparse.Namespace) -> list[dict[str, Any]]:
    maker = TextMaker(engine.tm.tokenizer)
    await one_point(engine, maker, 1, 16, 2, ns.seed + 99_991)  # warm-up
    rows = []
    points = itertools.product(ns.batch_size, ns.input_len, ns.output_len)
    for i, (batch, input_len, output_len) in enumerate(points):
        runs = [
            await one_point(engine, maker, batch, input_len, output_len, ns.seed + 1000 * i + k)
            for k in range(ns.repeat)
        ]
        rows.append(min(runs, key=lambda r: r["total_s"]))
        print(format_row(rows[-1]), flush=True)
    return rows


HEADER = f"{'batch':>6}{'in':>7}{'out':>6}{'prefill s':>11}{'prefill tok/s':>15}{'step ms':>10}{'decode tok/s':>14}"


def format_row(r: dict[str, Any]) -> str:
    return (
        f"{r['batch_size']:>6}{r['input_len']:>7}{r['output_len']:>6}{r['prefill_s']:>11.3f}"
        f"{r['prefill_tok_s']:>15.1f}{r['decode_step_ms']:>10.2f}{r['decode_tok_s']:>14.1f}"
    )


def main(ns: argparse.Namespace, argv: list[str] | None = None) -> int:
    engine = start_engine(ns)
    print(HEADER, flush=True)
    try:
        rows = asyncio.run(one_batch_bench(engine, ns))
    finally:
        engine.shutdown()
    if ns.output_file:
        for row in rows:
            append_jsonl(ns.output_file, {"command": "phloem bench one-batch " + " ".join(argv or []), **row})
    else:
        print(json.dumps(rows))
    return 0
