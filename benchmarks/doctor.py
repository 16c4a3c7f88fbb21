"""``phloem doctor``: replay a workload, read the server's own gauges, and say which setting to change.

    phloem doctor --url http://127.0.0.1:30000 --dataset shared-prefix --max-concurrency 16
    phloem doctor --dataset shared-prefix --apply --plot plots/ -- --max-running-requests 4
    phloem doctor --requests traffic.jsonl -- --chunked-prefill-size 256

With ``--url`` the doctor measures a running server; without it, it starts ``phloem serve`` itself
with the engine flags after ``--``. During the run it samples ``/get_server_info`` (running and
queued requests, KV pool usage) and reads ``/metrics`` before and after (retractions, cached
tokens, TTFT and ITL histograms); every request asks for its prefix report. The findings
(``doctor_rules``) come in a fixed order, each with its evidence and the flag to change.

``--apply`` (the doctor must have started the server) restarts it with the suggested flags, runs
the same workload again and prints both runs side by side, and charts them in
``doctor-plots/doctor_before_after.png`` (``--plot DIR`` for another folder) when matplotlib is
installed.

A JSONL workload (``--requests``) has one request per line: ``{"text": ..., "max_new_tokens": n}``
(or ``"prompt"`` for ``"text"``; ``max_new_tokens`` defaults to ``--output-len``). Outputs ignore EOS,
as in ``phloem bench serving``, so both runs of ``--apply`` generate the same number of tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from phloem.bench.doctor_rules import Finding, Snapshot, diagnose, format_findings, suggested_flags
from phloem.bench.prefix_summary import group_divergences

DEFAULT_PLOT_DIR = "doctor-plots"
SAMPLE_INTERVAL_S = 0.1  # the live stats are read between scheduler steps: sample often
READY_TIMEOUT_S = 300.0


# ---- arguments -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from phloem.bench.serving import add_dataset_args

    p = argparse.ArgumentParser(
        prog="phloem doctor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--url", default=None, help="a running server (else one is started with the flags after --)"
    )
    p.add_argument("--requests", default=None, metavar="FILE", help="a JSONL workload instead of --dataset")
    p.add_argument("--max-concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--apply", action="store_true", help="re-run with the suggested flags and compare")
    p.add_argument(
        "--plot",
        default=None,
        metavar="DIR",
        help=f"with --apply: where to chart before/after (default {DEFAULT_PLOT_DIR}; needs matplotlib)",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write the findings and runs as JSON")
    p.add_argument("--tokenizer", default="server", help="as for 'phloem bench serving'")
    add_dataset_args(p)
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(doctor flags, engine flags): the engine flags are everything after ``--``."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def with_flags(engine: list[str], changes: dict[str, str | None]) -> list[str]:
    """``engine`` with each flag of ``changes`` set (replaced where present, else appended)."""
    out: list[str] = []
    i = 0
    while i < len(engine):
        flag = engine[i].split("=", 1)[0]
        if flag in changes:
            takes_value = "=" not in engine[i] and i + 1 < len(engine) and not engine[i + 1].startswith("--")
            i += 2 if takes_value else 1
            continue
        out.append(engine[i])
        i += 1
    for flag, value in changes.items():
        out += [flag] if value is None else [flag, value]
    return out


# ---- the server ------------------------------------------------------------------------------------
class LocalServer:
    """``python -m phloem serve`` with the given engine flags on a free loopback port."""

    def __init__(self, flags: list[str]) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "phloem",
            "serve",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *flags,
        ]
        self.proc = subprocess.Popen(cmd)

    def wait_ready(self) -> None:
        import urllib.request

        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError("the server did not become healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- /metrics histograms ---------------------------------------------------------------------------
_BUCKET = re.compile(r'^phloem:(\w+)_bucket\{[^}]*le="([^"]+)"[^}]*\}\s+(\S+)$')


def histogram_buckets(text: str) -> dict[str, list[tuple[float, float]]]:
    """``{histogram: [(upper bound, cumulative count), ...]}`` from a Prometheus text body."""
    out: dict[str, list[tuple[float, float]]] = {}
    for line in text.splitlines():
        m = _BUCKET.match(line)
        if m:
            out.setdefault(m.group(1), []).append((float(m.group(2)), float(m.group(3))))
    return {k: sorted(v) for k, v in out.items()}


def quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> float:
    """The ``q`` quantile of the observations made between two scrapes, as the upper bound of the
    bucket it falls in (the last finite bound when it is past them; 0.0 without observations)."""
    old = dict(before)
    delta = [(le, count - old.get(le, 0.0)) for le, count in after]
    total = delta[-1][1] if delta else 0.0
    if total <= 0:
        return 0.0
    finite = [le for le, _ in delta if le != float("inf")]
    for le, count in delta:
        if count >= q * total:
            return le if le != float("inf") else (finite[-1] if finite else 0.0)
    return finite[-1] if finite else 0.0


def latency_figures(before: str, after: str) -> dict[str, float]:
    hb, ha = histogram_buckets(before), histogram_buckets(after)
    out = {}
    for short, name in (("ttft", "time_to_first_token_seconds"), ("itl", "inter_token_latency_seconds")):
        for q in (50, 99):
            out[f"{short}_p{q}"] = quantile(hb.get(name, []), ha.get(name, []), q / 100)
    return out


# ---- one run ---------------------------------------------------------------------------------------
@dataclass
class RunResult:
    flags: list[str]
    snapshot: Snapshot
    report: dict[str, Any]
    findings: list[Finding] = field(default_factory=list)


async def _get(session: Any, url: str) -> tuple[int, str]:
    async with session.get(url) as r:
        return r.status, await r.text()


async def measure_run(
    url: str, sessions: list[Any], tokenizer: Any, concurrency: int
) -> tuple[Snapshot, dict]:
    """Run ``sessions`` against ``url`` once, sampling the gauges; the snapshot and the bench report."""
    import aiohttp
    from phloem.bench.client import PhloemBackend
    from phloem.bench.report import counter_delta, parse_prometheus, summarize
    from phloem.bench.runner import RunOptions, run_sessions

    async with aiohttp.ClientSession() as http:
        status, info_text = await _get(http, url + "/get_server_info")
        if status != 200:
            raise RuntimeError(f"{url}/get_server_info answered {status}")
        info = json.loads(info_text)
        _, metrics_before = await _get(http, url + "/metrics")
        samples: list[dict[str, float]] = []
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                status, text = await _get(http, url + "/get_server_info")
                live = json.loads(text).get("live") if status == 200 else None
                if live:
                    samples.append(live)
                try:
                    await asyncio.wait_for(done.wait(), SAMPLE_INTERVAL_S)
                except asyncio.TimeoutError:
                    pass

        sampler = asyncio.create_task(sample())
        backend = PhloemBackend(url, prefix_report=True)
        try:
            results, duration = await run_sessions(
                backend, sessions, tokenizer, RunOptions(max_concurrency=concurrency, progress=False)
            )
        finally:
            done.set()
            await sampler
            await backend.close()
        _, metrics_after = await _get(http, url + "/metrics")
    counters = counter_delta(parse_prometheus(metrics_before), parse_prometheus(metrics_after))
    report = summarize(results, duration, scraped=counters)
    config = {k: v for k, v in info.items() if k != "live"}
    groups = group_divergences((r.prefix_report for r in results), top=5)
    snapshot = Snapshot(
        config=config,
        samples=samples,
        counters=counters,
        latency=latency_figures(metrics_before, metrics_after),
        requests=len(results),
        prefix_groups=[g.to_dict() for g in groups],
        shared_ceiling=shared_ceiling(sessions, tokenizer),
    )
    return snapshot, report


def shared_ceiling(sessions: list[Any], tokenizer: Any) -> float:
    """Share of the workload's first-turn prompt tokens that another prompt also starts with: one
    minus the size of the prompts' prefix tree over their total length (0.0 for fewer than two)."""
    ids = sorted(tokenizer.encode(s.turns[0].content) for s in sessions if not s.chat)
    total = sum(len(x) for x in ids)
    if len(ids) < 2 or not total:
        return 0.0
    # in sorted order, each prompt's longest common prefix with any other is with a neighbour
    return sum(_common_prefix(a, b) for a, b in zip(ids, ids[1:])) / total


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def load_requests(path: str, output_len: int) -> list[Any]:
    """A JSONL file of ``{"text"|"prompt": ..., "max_new_tokens"?: n}`` as one-turn sessions."""
    from phloem.bench.datasets import Session, Turn

    sessions: list[Session] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            text = row.get("text", row.get("prompt"))
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{n}: each line needs a non-empty 'text'")
            turn = Turn(content=text, output_len=int(row.get("max_new_tokens", output_len)))
            sessions.append(Session(sid=len(sessions), turns=(turn,)))
    if not sessions:
        raise ValueError(f"{path}: no requests")
    return sessions


async def run_once(ns: argparse.Namespace, url: str, flags: list[str]) -> RunResult:
    from phloem.bench.bench_tokenizer import bench_tokenizer
    from phloem.bench.datasets import build_dataset
    from phloem.bench.serving import dataset_options

    tokenizer = await bench_tokenizer(ns.tokenizer, url)
    if ns.requests:
        sessions = load_requests(ns.requests, ns.output_len)
    else:
        sessions = build_dataset(ns.dataset, tokenizer, dataset_options(ns))
    snapshot, report = await measure_run(url, sessions, tokenizer, ns.max_concurrency)
    return RunResult(flags, snapshot, report, diagnose(snapshot))


def serve_and_run(ns: argparse.Namespace, flags: list[str]) -> RunResult:
    server = LocalServer(flags)
    try:
        server.wait_ready()
        return asyncio.run(run_once(ns, server.url, flags))
    finally:
        server.stop()


# ---- output ----------------------------------------------------------------------------------------
COMPARED = (
    ("request_throughput", "requests/s", 1),
    ("output_throughput", "output tok/s", 1),
    ("mean_ttft_ms", "mean TTFT (ms)", 1),
    ("p99_ttft_ms", "p99 TTFT (ms)", 1),
    ("mean_itl_ms", "mean ITL (ms)", 1),
    ("cache_hit_rate", "cache hit rate", 100),
)


def run_summary(run: RunResult) -> dict[str, float]:
    s = run.snapshot
    out = {key: float(run.report.get(key) or 0.0) * scale for key, _, scale in COMPARED}
    out["peak_queue"] = s.peak("num_queue_reqs")
    out["peak_running"] = s.peak("num_running_reqs")
    out["retractions"] = s.counters.get("num_retracted_reqs_total", 0.0)
    return out


def format_side_by_side(before: RunResult, after: RunResult) -> str:
    labels = {key: label for key, label, _ in COMPARED}
    labels["cache_hit_rate"] = "cache hit rate (%)"
    labels |= {"peak_queue": "peak queue", "peak_running": "peak running", "retractions": "retractions"}
    b, a = run_summary(before), run_summary(after)
    lines = [
        f"{'':24}{'before':>14}{'after':>14}",
        f"{'flags':24}{' '.join(before.flags) or '(defaults)'}  ->  {' '.join(after.flags) or '(defaults)'}",
    ]
    for key, label in labels.items():
        lines.append(f"{label:24}{b[key]:>14.2f}{a[key]:>14.2f}")
    return "\n".join(lines)


def write_plot(before: RunResult, after: RunResult, directory: str) -> str:
    from phloem.bench.plots import _pyplot

    plt = _pyplot()
    os.makedirs(directory, exist_ok=True)
    b, a = run_summary(before), run_summary(after)
    keys = [k for k, _, _ in COMPARED]
    fig, axes = plt.subplots(1, len(keys), figsize=(3 * len(keys), 3.2))
    for ax, (key, label, _) in zip(axes, COMPARED):
        ax.bar(["before", "after"], [b[key], a[key]], color=["#999999", "#3a7bd5"])
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("phloem doctor: before and after the suggested flags")
    fig.tight_layout()
    path = os.path.join(directory, "doctor_before_after.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _print_run(title: str, run: RunResult) -> None:
    print(f"== {title}", flush=True)
    print(format_findings(run.findings), flush=True)


# ---- entry point -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    own, engine = split_argv(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    ns = parser.parse_args(own)
    if ns.apply and ns.url:
        parser.error(
            "--apply restarts the server with new flags: leave out --url and give engine flags after --"
        )
    if ns.url and engine:
        parser.error("engine flags after -- are for a server the doctor starts: leave out --url")
    if ns.plot and not ns.apply:
        parser.error("--plot charts the before/after runs of --apply")
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    if ns.plot and not has_matplotlib:  # before the runs, not after them
        parser.error("--plot needs matplotlib (pip install matplotlib)")
    plot_dir = ns.plot or (DEFAULT_PLOT_DIR if ns.apply and has_matplotlib else None)
    try:
        if ns.url:
            before = asyncio.run(run_once(ns, ns.url.rstrip("/"), []))
        else:
            before = serve_and_run(ns, engine)
    except (OSError, RuntimeError, TimeoutError, ValueError) as exc:
        print(f"phloem doctor: {exc}", file=sys.stderr, flush=True)
        return 2
    _print_run("findings", before)
    changes = suggested_flags(before.findings)
    out: dict[str, Any] = {"before": _record(before), "suggested": changes}
    if ns.apply:
        if not changes:
            print("== --apply: no engine flag to change", flush=True)
        else:
            after = serve_and_run(ns, with_flags(engine, changes))
            _print_run("findings after applying the suggested flags", after)
            print("== before and after", flush=True)
            print(format_side_by_side(before, after), flush=True)
            out["after"] = _record(after)
            if plot_dir:
                print(f"wrote {write_plot(before, after, plot_dir)}", flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _record(run: RunResult) -> dict[str, Any]:
    return {
        "flags": run.flags,
        "completed": run.report.get("completed", 0),
        "failed": run.report.get("failed", 0),
        "summary": run_summary(run),
        "findings": [f.__dict__ for f in run.findings],
        "prefix_groups": run.snapshot.prefix_groups,
    }


if __name__ == "__main__":
    raise SystemExit(main())
