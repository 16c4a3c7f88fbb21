"""phloem against a peer server on the same workload, in one run, alternating, with ratios.

    python benchmarks/compare.py --peer llama-server --dataset shared-prefix --num-groups 4 \\
        --prompts-per-group 8 --prefix-len 1024 --output-len 64 --max-concurrency 8,32 --rounds 2 \\
        --output results.json --plot compare.png

``--peer`` is ``hf`` (benchmarks/peers/hf_server.py), ``llama-server`` or ``llama-cpp-python``
(the scripts beside it), or ``url:http://host:port`` for a server you started. phloem is started
with ``python -m phloem serve`` (plus ``--phloem-args``) unless ``--phloem-url`` is given. Both
servers start once and serve every run; the peer gets room for ``--peer-slots`` requests at once
(default: the largest ``--max-concurrency``) and both get ``--threads`` CPU threads (default: every
core). Both are driven through the same OpenAI routes (``--backend openai``) with the same request
bodies.

Every (concurrency, round) pair is one run of both servers on dataset seed ``seed + run index``:
fresh text for each pair, so no run finds prompts an earlier run left in a cache, and the same text
for both servers. The order alternates from one pair to the next, so neither server always goes
first. The table shows the median over rounds and phloem / peer; ``input tokens`` is a fairness
check (1.00 when both servers counted the same prompts).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from phloem.bench.bench_tokenizer import load_tokenizer
from phloem.bench.client import OpenAIBackend
from phloem.bench.datasets import build_dataset
from phloem.bench.runner import ChatTokenizer, RunOptions
from phloem.bench.serving import (
    add_dataset_args,
    add_run_args,
    concurrency_list,
    dataset_options,
    first_model,
    measure,
    wait_ready,
    warm_up,
)

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = ("hf", "llama-server", "llama-cpp-python")
# metric -> (label, True when higher is better, False when lower is, None for a fairness check)
COMPARED: dict[str, tuple[str, bool | None]] = {
    "output_throughput": ("output tok/s", True),
    "request_throughput": ("req/s", True),
    "median_ttft_ms": ("median TTFT ms", False),
    "mean_ttft_ms": ("mean TTFT ms", False),
    "median_itl_ms": ("median ITL ms", False),
    "median_e2e_latency_ms": ("median E2E ms", False),
    "cache_hit_rate": ("cache hit rate", True),
    "total_input_tokens": ("input tokens", None),
    "total_output_tokens": ("output tokens", None),
}


@dataclasses.dataclass
class Server:
    """A server to benchmark: started from ``command`` unless it is None (then it already runs)."""

    name: str
    url: str
    command: list[str] | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    log: str = ""
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self.command is None:
            return
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,  # its own process group: stop() reaches every child
            )

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    async def wait_up(self, timeout: float) -> None:
        """Until ``/health`` answers 200; raises at once if the process exits first."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            try:
                await wait_ready(self.url, 2.0)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def phloem_command(port: int, threads: int | None, extra: list[str]) -> list[str]:
    serve = [sys.executable, "-m", "phloem", "serve", "--host", "127.0.0.1", "--port", str(port)]
    serve += ["--cpu-threads", str(threads)] if threads else []
    return [*serve, "--log-level", "warning", *extra]


def peer_command(
    peer: str, port: int, slots: int, threads: int | None, extra: list[str]
) -> tuple[list[str], dict[str, str]]:
    """The command that starts ``peer`` on ``port`` with room for ``slots`` requests, and its env."""
    if peer == "hf":
        script = os.path.join(HERE, "peers", "hf_server.py")
        cmd = [sys.executable, script, "--port", str(port), "--max-batch", str(slots)]
        return [*cmd, *(["--threads", str(threads)] if threads else []), *extra], {}
    script = os.path.join(HERE, "peers", peer.replace("-", "_") + ".sh")
    env = {"SLOTS": str(slots), "PYTHON": sys.executable} | ({"THREADS": str(threads)} if threads else {})
    return ["bash", script, str(port), *extra], env


def schedule(
    concurrencies: list[int | None], rounds: int, names: list[str], seed: int
) -> list[tuple[int | None, int, int, list[str]]]:
    """(concurrency, round, dataset seed, server order) of every run, in the order they happen."""
    out = []
    for ci, conc in enumerate(concurrencies):
        for k in range(rounds):
            i = ci * rounds + k
            out.append((conc, k, seed + i, names if i % 2 == 0 else names[::-1]))
    return out


async def one_run(
    url: str, ns: argparse.Namespace, conc: int | None, seed: int, tokenizer: ChatTokenizer
) -> dict[str, Any]:
    opt = dataclasses.replace(dataset_options(ns), seed=seed)
    sessions = build_dataset(ns.dataset, tokenizer, opt)
    backend = OpenAIBackend(url, model=await first_model(url, None))
    try:
        await warm_up(backend, tokenizer, ns.warmup_requests)
        run = RunOptions(conc, ns.request_rate, seed, ns.ignore_eos, not ns.disable_tqdm)
        report, _ = await measure(backend, sessions, tokenizer, run, metrics_url=url)
    finally:
        await backend.close()
    return report


async def run_all(servers: list[Server], ns: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run of every server, each with its concurrency, round, seed, position and load."""
    tokenizer = load_tokenizer(ns.tokenizer)
    for server in servers:
        await server.wait_up(ns.ready_timeout)
    by_name = {s.name: s for s in servers}
    concs = concurrency_list(ns.max_concurrency)
    runs = []
    for conc, k, seed, order in schedule(concs, ns.rounds, list(by_name), ns.seed):
        for position, name in enumerate(order):
            print(f"c={conc} round {k + 1}/{ns.rounds}: {name}", file=sys.stderr, flush=True)
            load_before = os.getloadavg()
            report = await one_run(by_name[name].url, ns, conc, seed, tokenizer)
            runs.append(
                {
                    "server": name,
                    "max_concurrency": conc,
                    "round": k,
                    "seed": seed,
                    "position": position,
                    "load_before": [round(x, 2) for x in load_before],
                    "load_after": [round(x, 2) for x in os.getloadavg()],
                    "report": report,
                }
            )
    return runs


def median_of(reports: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in reports if r.get(key) is not None]
    return statistics.median(values) if values else None


def ratio_table(reports: dict[str, list[dict[str, Any]]], peer: str) -> tuple[str, dict[str, Any]]:
    """Rows of median phloem, median peer and phloem / peer; ``higher_is_better`` says which way wins."""
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


def by_concurrency(runs: list[dict[str, Any]]) -> dict[int | None, dict[str, list[dict[str, Any]]]]:
    """``{concurrency: {server: [report per round]}}`` in the order the concurrencies first ran."""
    out: dict[int | None, dict[str, list[dict[str, Any]]]] = {}
    for run in runs:
        out.setdefault(run["max_concurrency"], {}).setdefault(run["server"], []).append(run["report"])
    return out


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain"))}


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }


def write_plot(records: list[dict[str, Any]], path: str) -> None:
    """Output tok/s and median TTFT against concurrency, one line per server: the median over rounds
    of the runs of every record (e.g. a concurrency-1 file and a concurrency-8,32 file)."""
    from phloem.bench.plots import _pyplot

    plt = _pyplot()
    servers = records[0]["servers"]
    table = by_concurrency([run for record in records for run in record["runs"]])
    concs = sorted(c for c in table if c is not None)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    metrics = (("output_throughput", "output tok/s"), ("median_ttft_ms", "median TTFT (ms)"))
    for ax, (key, label) in zip(axes, metrics):
        for name in servers:
            ys = [median_of(table[c].get(name, []), key) for c in concs]
            ax.plot(concs, ys, marker="o", label=name)
        ax.set(xlabel="max concurrency", ylabel=label, xscale="log", xticks=concs, xticklabels=concs)
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{records[0]['dataset']}: {' vs '.join(servers)} (median of rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", required=True, help="hf | llama-server | llama-cpp-python | url:http://...")
    p.add_argument("--phloem-url", default=None, help="use a running phloem server")
    p.add_argument("--phloem-args", default="", help="extra `phloem serve` flags, e.g. '--quantization int8'")
    p.add_argument("--peer-args", default="", help="extra flags for the peer's start script")
    p.add_argument("--peer-slots", type=int, default=None, help="peer requests at once (default: max conc.)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads of both servers (default: all)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--output", default=None, help="write the command, machine, medians and runs as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="write tok/s and TTFT vs concurrency")
    p.add_argument(
        "--tokenizer",
        default="default",
        help="builds prompts and counts tokens for both servers: 'default' (the default model's), a "
        "folder with tokenizer.json, a .gguf file or a model folder",
    )
    add_dataset_args(p)
    add_run_args(p)
    ns = p.parse_args(argv)
    if not ns.peer.startswith("url:") and ns.peer not in PEERS:
        p.error(f"--peer must be one of {', '.join(PEERS)} or url:...")
    concs = concurrency_list(ns.max_concurrency)
    slots = ns.peer_slots or max((c for c in concs if c), default=8)

    stamp = os.getpid()
    if ns.phloem_url:
        phloem = Server("phloem", ns.phloem_url)
    else:
        port = free_port()
        cmd = phloem_command(port, ns.threads, shlex.split(ns.phloem_args))
        phloem = Server("phloem", f"http://127.0.0.1:{port}", cmd, log=f"/tmp/compare-{stamp}-phloem.log")
    if ns.peer.startswith("url:"):
        peer = Server("peer", ns.peer[4:])
    else:
        port = free_port()
        cmd, env = peer_command(ns.peer, port, slots, ns.threads, shlex.split(ns.peer_args))
        peer = Server(ns.peer, f"http://127.0.0.1:{port}", cmd, env, f"/tmp/compare-{stamp}-{ns.peer}.log")

    record: dict[str, Any] = {
        "command": "python benchmarks/compare.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        **git_state(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "servers": [phloem.name, peer.name],
        "phloem_command": phloem.command,
        "peer_command": peer.command,
        "peer_env": peer.env,
        "dataset": ns.dataset,
        "dataset_options": dataclasses.asdict(dataset_options(ns)),
    }
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops both servers
    try:
        phloem.start()
        peer.start()
        record["runs"] = asyncio.run(run_all([phloem, peer], ns))
    finally:
        phloem.stop()
        peer.stop()

    record["summary"] = {}
    for conc, reports in by_concurrency(record["runs"]).items():
        table, ratios = ratio_table(reports, peer.name)
        print(f"\nmax concurrency {conc}:\n{table}")
        record["summary"][str(conc)] = ratios
    errors = [
        f"{r['server']} c={r['max_concurrency']}: {e}" for r in record["runs"] for e in r["report"]["errors"]
    ]
    for e in errors:
        print(f"ERROR: {e}")
    if ns.output:
        with open(ns.output, "w") as f:
            json.dump(record, f, indent=1)
    if ns.plot:
        write_plot([record], ns.plot)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
