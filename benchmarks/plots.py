"""PNG charts of serving runs (matplotlib, imported only here; ``pip install matplotlib``).

- ``ttft_cdf.png``: the CDF of time to first token, one line per run.
- ``latency_vs_concurrency.png`` and ``throughput_vs_concurrency.png`` when runs differ in
  ``max_concurrency``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from phloem.bench.client import Result

Run = tuple[dict[str, Any], list[Result]]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(report: dict[str, Any]) -> str:
    conc = report.get("max_concurrency")
    return f"{report.get('backend')} c={conc if conc is not None else 'inf'}"


def ttft_cdf(plt: Any, runs: Sequence[Run], path: str) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    for report, results in runs:
        xs = sorted(r.ttft * 1000 for r in results if r.success)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=_label(report))
    ax.set(xlabel="time to first token (ms)", ylabel="fraction of requests", title="TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def versus_concurrency(
    plt: Any, reports: Sequence[dict[str, Any]], keys: dict[str, str], ylabel: str, path: str
) -> str:
    xs = [r["max_concurrency"] for r in reports]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in keys.items():
        ax.plot(xs, [r[key] for r in reports], marker="o", label=label)
    ax.set(xlabel="max concurrency", ylabel=ylabel, xscale="log", title=f"{ylabel} vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


LATENCY_LINES = {
    "median_ttft_ms": "median TTFT",
    "p99_ttft_ms": "p99 TTFT",
    "median_e2e_latency_ms": "median E2E",
    "p99_e2e_latency_ms": "p99 E2E",
}
THROUGHPUT_LINES = {"output_throughput": "output tok/s", "input_throughput": "input tok/s"}


def write_plots(runs: Sequence[Run], folder: str) -> list[str]:
    """Write the charts into ``folder`` (created); returns their paths."""
    plt = _pyplot()
    os.makedirs(folder, exist_ok=True)
    paths = [ttft_cdf(plt, runs, os.path.join(folder, "ttft_cdf.png"))]
    reports = sorted((r for r, _ in runs if r.get("max_concurrency")), key=lambda r: r["max_concurrency"])
    if len({r["max_concurrency"] for r in reports}) > 1:
        paths.append(
            versus_concurrency(
                plt,
                reports,
                LATENCY_LINES,
                "latency (ms)",
                os.path.join(folder, "latency_vs_concurrency.png"),
            )
        )
        paths.append(
            versus_concurrency(
                plt,
                reports,
                THROUGHPUT_LINES,
                "tokens/s",
                os.path.join(folder, "throughput_vs_concurrency.png"),
            )
        )
    return paths
