"""``phloem bench serving``: an asyncio HTTP load generator for phloem or any OpenAI-compatible server.

    phloem bench serving --base-url http://127.0.0.1:30000 --dataset shared-prefix \\
        --num-groups 4 --prompts-per-group 8 --max-concurrency 1,4,8 --plot plots/

Each concurrency in ``--max-concurrency`` (comma separated) is one run with its own report; the
cache counters on ``/metrics`` are read before and after each run (after the warm-up), so each
report's cache hit rate covers that run alone.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import importlib.util
import sys
import time
from typing import Any

from phloem.bench.bench_tokenizer import TokenizerSourceError, bench_tokenizer
from phloem.bench.client import BACKENDS, Backend, Result
from phloem.bench.datasets import DATASETS, DatasetOptions, Session, build_dataset, warmup_sessions
from phloem.bench.prefix_summary import format_divergences, group_divergences
from phloem.bench.report import append_jsonl, counter_delta, format_report, parse_prometheus, summarize
from phloem.bench.runner import ChatTokenizer, RunOptions, run_sessions


# ---- arguments -------------------------------------------------------------------------------------
def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """``--dataset`` and one flag per ``DatasetOptions`` field (``--num-groups`` ...)."""
    p.add_argument("--dataset", choices=list(DATASETS), default="random")
    for f in dataclasses.fields(DatasetOptions):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, action="store_true", default=f.default)
        else:
            p.add_argument(flag, type={"int": int, "float": float}[str(f.type)], default=f.default)


def dataset_options(ns: argparse.Namespace) -> DatasetOptions:
    names = {f.name for f in dataclasses.fields(DatasetOptions)}
    return DatasetOptions(**{k: v for k, v in vars(ns).items() if k in names})


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-concurrency", default=None, help="cap on requests in flight; a list '1,8,32' runs each"
    )
    p.add_argument("--request-rate", type=float, default=float("inf"), help="sessions per second (Poisson)")
    p.add_argument("--warmup-requests", type=int, default=1, help="short requests sent before measuring")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="let EOS stop outputs")
    p.add_argument("--output-file", default=None, help="append one JSON line per run")
    p.add_argument("--output-details", action="store_true", help="include every request in the JSON line")
    p.add_argument("--disable-tqdm", action="store_true")


def add_serving_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:30000")
    p.add_argument("--backend", choices=list(BACKENDS), default="phloem")
    p.add_argument("--model", default=None, help="model name for OpenAI routes (default: /v1/models' first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts (needs matplotlib)")
    p.add_argument(
        "--prefix-report",
        action="store_true",
        help="ask for every request's prefix report (phloem backend) and print where prompts stopped "
        "matching the prefix cache, grouped by the text at the divergence",
    )
    p.add_argument(
        "--tokenizer",
        default="server",
        help="builds prompts and counts tokens: 'server' (the server's own, from GET /tokenizer), "
        "'default' (the default model's), a folder with tokenizer.json, a .gguf file or a model folder",
    )
    add_dataset_args(p)
    add_run_args(p)


def concurrency_list(value: str | None) -> list[int | None]:
    if not value:
        return [None]
    return [int(x) for x in str(value).split(",") if x.strip()]


def constrained_turns(sessions: list[Session]) -> dict[tuple[int, int], dict[str, Any]]:
    """The grammar of every constrained (session, turn), for the report's validity check."""
    return {
        (s.sid, i): {"json_schema": t.json_schema, "regex": t.regex}
        for s in sessions
        for i, t in enumerate(s.turns)
        if t.constrained
    }


def run_info(ns: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    return {
        "command": "phloem bench " + " ".join(argv or sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dataset": ns.dataset,
        "dataset_options": dataclasses.asdict(dataset_options(ns)),
        "request_rate": ns.request_rate,
    }


# ---- HTTP helpers ----------------------------------------------------------------------------------
async def scrape_metrics(base_url: str) -> dict[str, float] | None:
    """phloem's Prometheus counters, or None when the server has no such ``/metrics``."""
    import aiohttp

    try:
        async with aiohttp.ClientSession() as s, s.get(base_url.rstrip("/") + "/metrics") as resp:
            if resp.status != 200:
                return None
            parsed = parse_prometheus(await resp.text())
            return parsed or None
    except aiohttp.ClientError:
        return None


async def first_model(base_url: str, api_key: str | None) -> str | None:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with (
            aiohttp.ClientSession(headers=headers) as s,
            s.get(base_url.rstrip("/") + "/v1/models") as r,
        ):
            data = await r.json() if r.status == 200 else {}
    except (aiohttp.ClientError, ValueError):
        return None
    models = data.get("data") or []
    return models[0].get("id") if models else None


async def dummy_vocab(base_url: str, api_key: str | None, tokenizer: Any) -> tuple[int, int] | None:
    """(the model's token ids, the tokenizer's) when the server runs random weights
    (``load_format`` ``dummy`` on ``/get_server_info``), for ``report.token_check``; else None."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with (
            aiohttp.ClientSession(headers=headers) as s,
            s.get(base_url.rstrip("/") + "/get_server_info") as r,
        ):
            info = await r.json() if r.status == 200 else {}
    except (aiohttp.ClientError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("load_format") != "dummy" or not info.get("vocab_size"):
        return None
    return int(info["vocab_size"]), int(tokenizer.vocab_size)


async def wait_ready(base_url: str, timeout: float) -> None:
    """Poll ``/health`` until it answers 200 (raises TimeoutError)."""
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(base_url.rstrip("/") + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{base_url}/health did not answer 200 within {timeout:.0f}s")


# ---- one measured run ------------------------------------------------------------------------------
async def measure(
    backend: Backend,
    sessions: list[Session],
    tokenizer: ChatTokenizer,
    opt: RunOptions,
    *,
    metrics_url: str | None = None,
    vocab: tuple[int, int] | None = None,
) -> tuple[dict[str, Any], list[Result]]:
    """Run the sessions once; the report holds metrics only (the caller adds configuration).
    ``vocab``: (model, tokenizer) vocabulary sizes where known (see ``report.token_check``)."""
    before = await scrape_metrics(metrics_url) if metrics_url else None
    results, duration = await run_sessions(backend, sessions, tokenizer, opt)
    after = await scrape_metrics(metrics_url) if metrics_url else None
    scraped = counter_delta(before, after) if before and after else None
    report = summarize(
        results, duration, scraped=scraped, constrained=constrained_turns(sessions), vocab=vocab
    )
    return report, results


async def warm_up(backend: Backend, tokenizer: ChatTokenizer, count: int) -> None:
    if count <= 0:
        return
    opt = RunOptions(max_concurrency=1, progress=False)
    results, _ = await run_sessions(backend, warmup_sessions(tokenizer, count), tokenizer, opt)
    bad = [r.error for r in results if not r.success]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0]}")


Run = tuple[dict[str, Any], list[Result]]


async def serve_bench(ns: argparse.Namespace, argv: list[str] | None) -> list[Run]:
    """(report, results) per concurrency level; reports are printed and optionally written as JSON lines."""
    tokenizer = await bench_tokenizer(ns.tokenizer, ns.base_url, ns.api_key)
    sessions = build_dataset(ns.dataset, tokenizer, dataset_options(ns))
    model = ns.model or (await first_model(ns.base_url, ns.api_key) if ns.backend == "openai" else None)
    vocab = await dummy_vocab(ns.base_url, ns.api_key, tokenizer)
    runs: list[Run] = []
    for conc in concurrency_list(ns.max_concurrency):
        backend = BACKENDS[ns.backend](
            ns.base_url, model=model, api_key=ns.api_key, prefix_report=ns.prefix_report
        )
        try:
            await warm_up(backend, tokenizer, ns.warmup_requests)
            opt = RunOptions(conc, ns.request_rate, ns.seed, ns.ignore_eos, not ns.disable_tqdm)
            report, results = await measure(
                backend, sessions, tokenizer, opt, metrics_url=ns.base_url, vocab=vocab
            )
        finally:
            await backend.close()
        report = {
            **run_info(ns, argv),
            "backend": ns.backend,
            "base_url": ns.base_url,
            "tokenizer": ns.tokenizer,
            "max_concurrency": conc,
        } | report
        if ns.prefix_report:
            groups = group_divergences(r.prefix_report for r in results)
            report["prefix_divergences"] = [g.to_dict() for g in groups]
        runs.append((report, results))
        print(format_report(report), flush=True)
        if ns.prefix_report:
            print(format_divergences(groups, len(results)), flush=True)
        if ns.output_file:
            details = {"requests": [r.to_record() for r in results]} if ns.output_details else {}
            append_jsonl(ns.output_file, report | details)
    return runs


def main(ns: argparse.Namespace, argv: list[str] | None = None) -> int:
    if ns.plot and importlib.util.find_spec("matplotlib") is None:  # before the run, not after it
        print(
            "phloem bench serving: --plot needs matplotlib (pip install 'phloem[bench]' or matplotlib)",
            file=sys.stderr,
            flush=True,
        )
        return 2
    if ns.prefix_report and ns.backend != "phloem":
        print("phloem bench serving: --prefix-report needs --backend phloem", file=sys.stderr, flush=True)
        return 2
    try:
        runs = asyncio.run(serve_bench(ns, argv))
    except TokenizerSourceError as exc:
        print(f"phloem bench serving: {exc}", file=sys.stderr, flush=True)
        return 2
    if ns.plot:
        from phloem.bench.plots import write_plots

        for path in write_plots(runs, ns.plot):
            print(f"wrote {path}")
    return 1 if any(report["errors"] for report, _ in runs) else 0
