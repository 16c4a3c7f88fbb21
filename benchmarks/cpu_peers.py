"""The default model on the CPU against llama.cpp's llama-server and transformers: one table, one plot.

    LLAMA_SERVER=/path/to/llama-server python benchmarks/cpu_peers.py --threads 2 \\
        --out-dir benchmarks/results/cpu/peers --plot docs/plots/peers/cpu_peers.png

Runs ``benchmarks/compare.py`` (both servers started once per workload, runs alternating, same
request bodies, same threads) for each workload below, then prints the markdown table of
``docs/benchmarks.md`` (output tok/s, median TTFT and median ITL per server and concurrency,
phloem / peer) and draws every workload's three metrics against concurrency in one figure.

=============  ==========================================================  ================
workload       requests                                                    concurrency
=============  ==========================================================  ================
random         32 prompts of 128 tokens, 64 output tokens                  1, 8, 32
multi-turn     32 chats of 3 turns (each turn resends the history)          1, 8, 32
agent          32 tool loops of 4 steps on one system prompt and tool list  1, 8, 32
prefill-512    4 prompts of 512 tokens, 1 output token (TTFT = prefill)     1
prefill-2048   4 prompts of 2,048 tokens, 1 output token                    1
transformers   random as above against ``--peer hf`` (16 prompts)           1, 8
=============  ==========================================================  ================

``--quick`` shrinks every workload (a smoke test of the script, not a measurement); ``--only``
picks workloads; ``--skip-hf`` leaves transformers out. Needs a ``llama-server`` binary
(``benchmarks/peers/llama_server.sh`` says where it is looked for).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from phloem.bench import compare

HERE = os.path.dirname(os.path.abspath(__file__))

RANDOM = ["--dataset", "random", "--random-input-len", "128", "--random-output-len", "64"]
WORKLOADS: dict[str, dict[str, Any]] = {
    "random": {"peer": "llama-server", "args": [*RANDOM, "--num-prompts", "32"], "conc": "1,8,32"},
    "multi-turn": {
        "peer": "llama-server",
        "args": ["--dataset", "multi-turn", "--num-conversations", "32", "--num-turns", "3"],
        "conc": "1,8,32",
    },
    "agent": {
        "peer": "llama-server",
        "args": ["--dataset", "agent", "--num-agents", "32", "--num-steps", "4"],
        "conc": "1,8,32",
    },
    "prefill-512": {
        "peer": "llama-server",
        "args": ["--dataset", "random", "--random-input-len", "512", "--random-output-len", "1", "--num-prompts", "4"],
        "conc": "1",
    },
    "prefill-2048": {
        "peer": "llama-server",
        "args": ["--dataset", "random", "--random-input-len", "2048", "--random-output-len", "1", "--num-prompts", "4"],
        "conc": "1",
    },
    "transformers": {"peer": "hf", "args": [*RANDOM, "--num-prompts", "16"], "conc": "1,8"},
}
QUICK = {"--num-prompts": "4", "--num-conversations": "2", "--num-agents": "2", "--num-steps": "2", "--num-turns": "2"}
METRICS = (("output_throughput", "output tok/s"), ("median_ttft_ms", "median TTFT (ms)"), ("median_itl_ms", "median ITL (ms)"))


def quick(args: list[str]) -> list[str]:
    """``args`` with the request counts of :data:`QUICK`."""
    return [QUICK.get(args[i - 1], a) if i else a for i, a in enumerate(args)]


def run_workload(name: str, spec: dict[str, Any], ns: argparse.Namespace) -> dict[str, Any]:
    out = os.path.join(ns.out_dir, f"{name}.json")
    argv = ["--peer", spec["peer"], *spec["args"], "--max-concurrency", spec["conc"], "--rounds", str(ns.rounds)]
    argv += ["--output", out, "--disable-tqdm"]
    argv += ["--threads", str(ns.threads)] if ns.threads else []
    argv += ["--peer-slots", "8"] if spec["peer"] == "hf" else []
    if ns.quick:
        argv = quick(argv) + ["--rounds", "1"]
    print(f"== {name}: compare.py {' '.join(argv)}", flush=True)
    code = compare.main(argv)
    with open(out) as f:
        record = json.load(f)
    record["exit_code"] = code
    return record


def table(records: dict[str, dict[str, Any]]) -> str:
    """Markdown rows: workload, concurrency, then each metric as phloem / peer (ratio)."""
    lines = [
        "| workload | peer | concurrency | output tok/s: phloem / peer | median TTFT ms | median ITL ms |",
        "|---|---|---:|---|---|---|",
    ]
    for name, rec in records.items():
        peer = rec["servers"][1]
        label = "transformers" if peer == "hf" else peer
        for conc, ratios in rec["summary"].items():
            cells = []
            for key, _ in METRICS:
                r = ratios[key]
                a, b = r["phloem"], r[peer]
                cells.append("-" if not a or not b else f"{a:,.1f} / {b:,.1f} ({a / b:.2f}x)")
            lines.append(f"| {name} | {label} | {conc} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records: dict[str, dict[str, Any]], path: str) -> None:
    """One row per workload with several concurrencies: tok/s, TTFT and ITL against concurrency."""
    from phloem.bench.plots import _pyplot

    plt = _pyplot()
    rows = [(n, r) for n, r in records.items() if len(r["summary"]) > 1]
    if not rows:
        return
    fig, axes = plt.subplots(len(rows), 3, figsize=(13, 3.2 * len(rows)), squeeze=False)
    for (name, rec), ax_row in zip(rows, axes):
        table_ = compare.by_concurrency(rec["runs"])
        concs = sorted(c for c in table_ if c is not None)
        for ax, (key, label) in zip(ax_row, METRICS):
            for server in rec["servers"]:
                ys = [compare.median_of(table_[c].get(server, []), key) for c in concs]
                ax.plot(concs, ys, marker="o", label="transformers" if server == "hf" else server)
            ax.set(xlabel="max concurrency", ylabel=label, xscale="log", xticks=concs, xticklabels=concs, title=name)
            ax.minorticks_off()
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M on the CPU, same GGUF and threads: phloem vs llama-server vs transformers")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None, help="CPU threads of every server (default: all)")
    p.add_argument("--rounds", type=int, default=1, help="rounds per concurrency (compare.py --rounds)")
    p.add_argument("--out-dir", default=os.path.join(HERE, "results", "cpu", "peers"))
    p.add_argument("--plot", default=None, metavar="PNG")
    p.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads")
    p.add_argument("--skip-hf", action="store_true", help="leave the transformers workload out")
    p.add_argument("--quick", action="store_true", help="tiny workloads: checks the script, measures nothing")
    ns = p.parse_args(argv)
    names = [n for n in ns.only.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    if ns.skip_hf:
        names = [n for n in names if WORKLOADS[n]["peer"] != "hf"]
    os.makedirs(ns.out_dir, exist_ok=True)
    records = {n: run_workload(n, WORKLOADS[n], ns) for n in names}
    md = table(records)
    print("\n" + md)
    with open(os.path.join(ns.out_dir, "table.md"), "w") as f:
        f.write(md + "\n")
    if ns.plot:
        plot(records, ns.plot)  # redraw later: plot({name: json.load(...)}, path)
    return max((r["exit_code"] for r in records.values()), default=0)


if __name__ == "__main__":
    raise SystemExit(main())
