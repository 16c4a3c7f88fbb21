"""``phloem bench offline``: every prompt of a dataset through an in-process Engine, no HTTP.

    phloem bench offline --dataset shared-prefix --num-groups 4 --prompts-per-group 8

All sessions are submitted at once (unless ``--max-concurrency``); the report is the serving
report, measured on the Engine's streamed outputs, so it includes throughput and latencies.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from phloem.bench.client import EngineBackend
from phloem.bench.datasets import build_dataset
from phloem.bench.report import append_jsonl, format_report
from phloem.bench.runner import RunOptions
from phloem.bench.serving import add_dataset_args, add_run_args, dataset_options, measure, run_info, warm_up


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from phloem.runtime.config import EngineArgs

    EngineArgs.add_cli_args(p)
    p.set_defaults(log_level="warning")


def start_engine(ns: argparse.Namespace) -> Any:
    from phloem.runtime.config import EngineArgs
    from phloem.runtime.engine import Engine

    args = EngineArgs.from_cli(ns).to_dict()
    return Engine(**args)


def add_offline_args(p: argparse.ArgumentParser) -> None:
    add_dataset_args(p)
    add_run_args(p)
    add_engine_args(p)


async def offline_bench(engine: Any, ns: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    tokenizer = engine.tm.tokenizer
    sessions = build_dataset(ns.dataset, tokenizer, dataset_options(ns))
    backend = EngineBackend(engine)
    await warm_up(backend, tokenizer, ns.warmup_requests)
    conc = int(ns.max_concurrency) if ns.max_concurrency else None
    opt = RunOptions(conc, ns.request_rate, ns.seed, ns.ignore_eos, not ns.disable_tqdm)
    # Random weights emit any id of the model's vocabulary; a trained model's padded ids are never
    # sampled in practice, so only a dummy model's counts are excused (report.token_check).
    vocab = (engine.tm.vocab_size, tokenizer.vocab_size) if ns.load_format == "dummy" else None
    report, _ = await measure(backend, sessions, tokenizer, opt, vocab=vocab)
    return {**run_info(ns, argv), "backend": "engine", "max_concurrency": conc} | report


def main(ns: argparse.Namespace, argv: list[str] | None = None) -> int:
    if ns.max_concurrency and "," in str(ns.max_concurrency):
        raise SystemExit("offline takes one --max-concurrency value")
    engine = start_engine(ns)
    try:
        report = asyncio.run(offline_bench(engine, ns, argv))
    finally:
        engine.shutdown()
    print(format_report(report).replace("Serving benchmark", "Offline benchmark"), flush=True)
    if ns.output_file:
        append_jsonl(ns.output_file, report)
    return 1 if report["errors"] else 0
