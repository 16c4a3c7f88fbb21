"""phloem against a peer server on the same workload, in one run, alternating, with ratios.

    python benchmarks/compare.py --peer hf --dataset shared-prefix --num-groups 2 \\
        --prompts-per-group 4 --prefix-len 256 --output-len 16 --max-concurrency 4 --rounds 2

``--peer`` is ``hf`` (benchmarks/peers/hf_server.py), ``llama-server`` or ``llama-cpp-python``
(the scripts beside it), or ``url:http://host:port`` for a server you started. phloem is started
with ``python -m phloem serve`` unless ``--phloem-url`` is given. Both are driven through the same
OpenAI routes (``--backend openai``) so the request path is the same. Round ``k`` uses dataset seed
``seed + k`` for both servers (fresh text each round, same shapes), and the order alternates
between rounds so neither server always runs first. The table shows the median over rounds and
phloem / peer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from phloem.bench.client import OpenAIBackend
from phloem.bench.datasets import build_dataset
from phloem.bench.runner import RunOptions
from phloem.bench.serving import (
    add_dataset_args,
    add_run_args,
    dataset_options,
    first_model,
    load_tokenizer,
    measure,
    wait_ready,
    warm_up,
)

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_COMMANDS = {
    "hf": [sys.executable, os.path.join(HERE, "peers", "hf_server.py"), "--port"],
    "llama-server": ["bash", os.path.join(HERE, "peers", "llama_server.sh")],
    "llama-cpp-python": ["bash", os.path.join(HERE, "peers", "llama_cpp_python.sh")],
}
COMPARED = {
    "output_throughput": ("output tok/s", True),
    "request_throughput": ("req/s", True),
    "mean_ttft_ms": ("mean TTFT ms", False),
    "median_itl_ms": ("median ITL ms", False),
    "median_e2e_latency_ms": ("median E2E ms", False),
    "cache_hit_rate": ("cache hit rate", True),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started(command: list[str] | None, url: str, log: str) -> Iterator[str]:
    """Start ``command`` (logging to ``log``) unless it is None; stop it on exit."""
    if command is None:
        yield url
        return
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def phloem_target(ns: argparse.Namespace) -> tuple[list[str] | None, str]:
    if ns.phloem_url:
        return None, ns.phloem_url
    port = free_port()
    return [
        sys.executable,
        "-m",
        "phloem",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ], f"http://127.0.0.1:{port}"


def peer_target(ns: argparse.Namespace) -> tuple[list[str] | None, str]:
    if ns.peer.startswith("url:"):
        return None, ns.peer[4:]
    port = free_port()
    return [*PEER_COMMANDS[ns.peer], str(port)], f"http://127.0.0.1:{port}"


async def one_run(url: str, ns: argparse.Namespace, seed: int, tokenizer: Any) -> dict[str, Any]:
    opt = dataclasses.replace(dataset_options(ns), seed=seed)
    sessions = build_dataset(ns.dataset, tokenizer, opt)
    backend = OpenAIBackend(url, model=await first_model(url, None))
    try:
        await warm_up(backend, tokenizer, ns.warmup_requests)
        conc = int(ns.max_concurrency) if ns.max_concurrency else None
        run = RunOptions(conc, ns.request_rate, seed, ns.ignore_eos, not ns.disable_tqdm)
        report, _ = await measure(backend, sessions, tokenizer, run, metrics_url=url)
    finally:
        await backend.close()
    return report


async def alternate(urls: dict[str, str], ns: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    tokenizer = load_tokenizer(ns.tokenizer)
    for url in urls.values():
        await wait_ready(url, ns.ready_timeout)
    reports: dict[str, list[dict[str, Any]]] = {name: [] for name in urls}
    names = list(urls)
    for k in range(ns.rounds):
        for name in names if k % 2 == 0 else names[::-1]:
            print(f"round {k + 1}/{ns.rounds}: {name}", file=sys.stderr, flush=True)
            reports[name].append(await one_run(urls[name], ns, ns.seed + k, tokenizer))
    return reports


def median_of(reports: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in reports if r.get(key) is not None]
    return statistics.median(values) if values else None


def ratio_table(reports: dict[str, list[dict[str, Any]]], peer: str) -> tuple[str, dict[str, Any]]:
    """Rows of median phloem, median peer and phloem / peer; ``better`` says which direction wins."""
    head = f"{'metric':<18}{'phloem':>12}{peer:>18}{'phloem/peer':>13}"
    lines, ratios = [head, "-" * len(head)], {}
    for key, (label, higher_better) in COMPARED.items():
        a, b = median_of(reports["phloem"], key), median_of(reports[peer], key)
        ratio = a / b if a is not None and b else None
        ratios[key] = {"phloem": a, peer: b, "ratio": ratio, "higher_is_better": higher_better}
        lines.append(f"{label:<18}{_cell(a):>12}{_cell(b):>18}{_cell(ratio):>13}")
    failed = {name: sum(r["failed"] for r in rs) for name, rs in reports.items()}
    lines.append(f"failed requests: {failed}")
    return "\n".join(lines), ratios


def _cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", required=True, help="hf | llama-server | llama-cpp-python | url:http://...")
    p.add_argument("--phloem-url", default=None, help="use a running phloem server")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--output", default=None, help="write medians, ratios and every report as JSON")
    add_dataset_args(p)
    add_run_args(p)
    ns = p.parse_args(argv)
    if not ns.peer.startswith("url:") and ns.peer not in PEER_COMMANDS:
        p.error(f"--peer must be one of {', '.join(PEER_COMMANDS)} or url:...")
    peer_name = "peer" if ns.peer.startswith("url:") else ns.peer
    (pcmd, purl), (qcmd, qurl) = phloem_target(ns), peer_target(ns)
    with (
        started(pcmd, purl, "/tmp/phloem-compare-phloem.log"),
        started(qcmd, qurl, f"/tmp/phloem-compare-{peer_name}.log"),
    ):
        reports = asyncio.run(alternate({"phloem": purl, peer_name: qurl}, ns))
    table, ratios = ratio_table(reports, peer_name)
    print(table)
    if ns.output:
        with open(ns.output, "w") as f:
            json.dump({"argv": argv or sys.argv[1:], "ratios": ratios, "reports": reports}, f, indent=2)
    return 1 if any(r["errors"] for rs in reports.values() for r in rs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
