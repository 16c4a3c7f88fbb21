"""Hierarchical cache benchmark: shared system prompts that outnumber the device pool.

Workload (``--scale 1``): groups of 8 users; the users of a group share a 2,048-token system prompt,
then ask a 32-token question; 32 output tokens (``ignore_eos``, greedy); 8 requests in flight. Users
arrive in random order (``--order random``, seeded) or round-robin over the groups (user 0 of every
group, then user 1 of every group, ...). The device KV pool holds about 11 prompts, so with more
groups the radix cache alone has often evicted a prompt before it is reused; with
``--enable-hierarchical-cache`` it comes back from the host pool (``--hicache-ratio`` x the device
pool, 4 by default: 44 prompts, the working set of 32 groups).

What to expect from LRU tiers: ``write_through`` keeps device content on the host too, so device
and host together hold ``ratio`` x 11 prompts; ``write_back`` keeps them apart (``(ratio + 1)`` x 11).
A strictly cyclic order over more groups than fit gets no hits from any LRU cache; a random order
gets the fraction that fits.

For each number of groups (default 8, 32, 64) the same requests run through an Engine without and
with the hierarchical cache (one Engine per arm, its cache flushed between group counts, warmed up
first on a group of its own so kernel compilation is not timed); the table shows mean and p90
TTFT, output and total token throughput, the share of prompt tokens served from cache, and how many
came from the host tier.

    python benchmarks/hicache.py --scale 0.125 --groups 8,16,32            # CPU, a few minutes
    python benchmarks/hicache.py --device cuda --load-format dummy \\
        --tokenizer-path .gputok --out $OUT/hicache.json                    # on a GPU

``--scale`` shrinks the system prompt, question and output lengths (and with them the device pool,
which stays at ~11 prompts); the group size and the shape of the workload stay. ``--load-format
dummy`` runs random weights of ``--dummy-shape`` (greedy text is meaningless, lengths are fixed by
``ignore_eos``, so TTFT and throughput still are). Results (command, commit, date, device, figures)
go to ``--out`` (default ``benchmarks/results/cpu/hicache.json``); the commit is ``git rev-parse HEAD``,
or ``$GIT_COMMIT`` where there is no repository.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from typing import Any

from phloem.bench.client import EngineBackend
from phloem.bench.datasets import DatasetOptions, Session, TextMaker, shared_prefix_dataset
from phloem.bench.runner import RunOptions, run_sessions

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "cpu", "hicache.json")
# live-stat counters reported per run, as the difference over the run (they count from startup)
COUNTERS = ("hicache_host_hit_tokens", "hicache_loaded_tokens", "hicache_bytes_host_to_device",
            "hicache_backed_up_tokens")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Workload:
    users_per_group: int = 8
    prefix_len: int = 2048
    question_len: int = 32
    output_len: int = 32
    in_flight: int = 8
    pool_prompts: float = 11.0  # device pool size, in prompts (prefix + question + output)
    order: str = "random"  # or "roundrobin"
    write_policy: str = "write_through"
    hicache_ratio: float = 4.0  # host pool size as a multiple of the device pool

    @classmethod
    def scaled(cls, scale: float) -> Workload:
        full = cls()
        return cls(
            prefix_len=max(64, round(full.prefix_len * scale)),
            question_len=max(8, round(full.question_len * scale)),
            output_len=max(4, round(full.output_len * scale)),
        )

    @property
    def pool_tokens(self) -> int:
        return round(self.pool_prompts * (self.prefix_len + self.question_len + self.output_len))

    def sessions(self, tokenizer: Any, groups: int, *, seed: int = 0) -> list[Session]:
        """Round-robin over groups (user u of group g is request ``u * groups + g``) or shuffled."""
        opts = DatasetOptions(num_groups=groups, prompts_per_group=self.users_per_group,
                              prefix_len=self.prefix_len, question_len=self.question_len,
                              output_len=self.output_len, seed=seed)  # fmt: skip
        by_group = shared_prefix_dataset(TextMaker(tokenizer), opts)
        order = [
            by_group[g * self.users_per_group + u] for u in range(self.users_per_group) for g in range(groups)
        ]
        if self.order == "random":
            random.Random(1).shuffle(order)
        return [dataclasses.replace(s, sid=i) for i, s in enumerate(order)]


def engine_flags(args: argparse.Namespace, work: Workload, *, hicache: bool) -> dict[str, Any]:
    """Engine keywords of one arm: the model options given on the command line, the device pool
    of ``work``, and the hierarchical cache when ``hicache``."""
    flags: dict[str, Any] = {"max_total_tokens": work.pool_tokens, "device": args.device}
    for name in ("model_path", "load_format", "dummy_shape", "tokenizer_path", "dtype", "attention_backend"):
        if getattr(args, name) is not None:
            flags[name] = getattr(args, name)
    if hicache:
        flags.update(enable_hierarchical_cache=True, hicache_write_policy=work.write_policy,
                     hicache_ratio=work.hicache_ratio)  # fmt: skip
    return flags


def run_arm(
    args: argparse.Namespace, work: Workload, groups: list[int], *, hicache: bool
) -> list[dict[str, Any]]:
    """Every group count through one Engine (cache flushed in between); one row per group count."""
    from phloem import Engine

    started = time.perf_counter()
    engine = Engine(log_level="warning", **engine_flags(args, work, hicache=hicache))
    startup = time.perf_counter() - started
    try:
        return asyncio.run(_arm(engine, work, groups, hicache=hicache, startup=startup))
    finally:
        engine.shutdown()


async def _arm(
    engine: Any, work: Workload, groups: list[int], *, hicache: bool, startup: float
) -> list[dict[str, Any]]:
    tok = engine.tm.tokenizer
    backend = EngineBackend(engine)
    # one group of its own: a full prefill, then extends over a cache hit in batches of the run's
    # size, so kernel compilation and allocator growth are not timed (the first arm would pay them)
    warm = dataclasses.replace(work, users_per_group=work.in_flight + 1).sessions(tok, 1, seed=10_007)
    await _run(backend, tok, warm[:1], in_flight=1)
    await _run(backend, tok, warm[1:], in_flight=work.in_flight)
    rows = []
    for g in groups:
        if not engine.flush_cache(timeout=60):  # blocking calls: nothing else runs between two runs
            raise RuntimeError("the engine did not go idle for a cache flush")
        before = engine.get_server_info()["live"]
        results, wall = await _run(backend, tok, work.sessions(tok, g), in_flight=work.in_flight)
        live = engine.get_server_info()["live"]
        row = {"groups": g, "hicache": hicache, **summarize(results, wall)}
        row.update({k.removeprefix("hicache_"): live.get(k, 0) - before.get(k, 0) for k in COUNTERS})
        row["engine_startup_s"] = startup
        rows.append(row)
        print(format_table([row]).splitlines()[-1], flush=True)
    return rows


async def _run(backend: Any, tok: Any, sessions: list[Session], *, in_flight: int) -> tuple[list[Any], float]:
    results, wall = await run_sessions(
        backend, sessions, tok, RunOptions(max_concurrency=in_flight, progress=False, ignore_eos=True)
    )
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
    return results, wall


def summarize(results: list[Any], wall: float) -> dict[str, Any]:
    ttft = sorted(r.ttft for r in results)
    out_tokens = sum(r.server_output_tokens or 0 for r in results)
    prompt = sum(r.server_prompt_tokens or 0 for r in results)
    return {
        "requests": len(results),
        "wall_s": wall,
        "mean_ttft_ms": 1000 * sum(ttft) / len(ttft),
        "p50_ttft_ms": 1000 * ttft[len(ttft) // 2],
        "p90_ttft_ms": 1000 * ttft[min(len(ttft) - 1, (9 * len(ttft)) // 10)],
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + prompt) / wall,
        "cache_hit_rate": sum(r.cached_tokens or 0 for r in results) / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'groups':>7}{'hicache':>9}{'reqs':>6}{'wall s':>9}{'mean TTFT ms':>14}{'p90 TTFT ms':>13}"
            f"{'out tok/s':>11}{'total tok/s':>13}{'cache hit':>11}{'host hits':>11}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['groups']:>7}{'on' if r['hicache'] else 'off':>9}{r['requests']:>6}{r['wall_s']:>9.1f}"
            f"{r['mean_ttft_ms']:>14.1f}{r['p90_ttft_ms']:>13.1f}{r['output_tok_s']:>11.1f}"
            f"{r['total_tok_s']:>13.0f}{r['cache_hit_rate']:>10.0%}{r['host_hit_tokens']:>11}"
        )
    return "\n".join(lines)


def speedups(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per group count: mean TTFT without / with the hierarchical cache, and the throughput ratio."""
    by = {(r["groups"], r["hicache"]): r for r in rows}
    out = {}
    for g in sorted({r["groups"] for r in rows}):
        off, on = by.get((g, False)), by.get((g, True))
        if off and on:
            out[str(g)] = {
                "mean_ttft": off["mean_ttft_ms"] / on["mean_ttft_ms"],
                "total_tok_s": on["total_tok_s"] / off["total_tok_s"],
            }
    return out


def git_commit() -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("GIT_COMMIT", "unknown")


def device_name(device: str) -> str:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (torch {torch.__version__})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="shrink prompt, question and output lengths")
    ap.add_argument("--groups", default="8,32,64", help="comma-separated numbers of groups")
    ap.add_argument("--users", type=int, default=8, help="users per group")
    ap.add_argument("--order", default="random", choices=["random", "roundrobin"], help="arrival order")
    ap.add_argument(
        "--write-policy", default="write_through", help="--hicache-write-policy of the HiCache runs"
    )
    ap.add_argument(
        "--hicache-ratio", type=float, default=4.0, help="host pool / device pool of the HiCache runs"
    )
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--model-path", default=None, help="model (default: the default model)")
    ap.add_argument("--load-format", default=None, help="auto, gguf, safetensors or dummy")
    ap.add_argument("--dummy-shape", default=None, help="shape of --load-format dummy (default smollm2-135m)")
    ap.add_argument(
        "--tokenizer-path", default=None, help="tokenizer folder or GGUF (needed with dummy off this repo)"
    )
    ap.add_argument("--dtype", default=None, help="compute dtype (default: the engine's)")
    ap.add_argument("--attention-backend", default=None, help="attention kernels (default: the engine's)")
    ap.add_argument("--out", default=RESULTS, help="JSON results file")
    ap.add_argument("--no-save", action="store_true", help="do not write the results file")
    args = ap.parse_args(argv)
    work = dataclasses.replace(
        Workload.scaled(args.scale),
        users_per_group=args.users,
        order=args.order,
        write_policy=args.write_policy,
        hicache_ratio=args.hicache_ratio,
    )
    groups = [int(g) for g in args.groups.split(",")]
    print(f"workload: {work} device pool {work.pool_tokens} tokens (scale {args.scale})", flush=True)
    started = time.perf_counter()
    rows = [*run_arm(args, work, groups, hicache=False), *run_arm(args, work, groups, hicache=True)]
    rows.sort(key=lambda r: (r["groups"], r["hicache"]))
    print(format_table(rows))
    ratios = speedups(rows)
    for g, s in ratios.items():
        print(f"{g} groups: mean TTFT without / with HiCache {s['mean_ttft']:.2f}, "
              f"total tok/s with / without {s['total_tok_s']:.2f}")  # fmt: skip
    if args.no_save:
        return
    report = {
        "benchmark": "hicache",
        "command": shlex.join(["python", *sys.argv]),
        "git_commit": git_commit(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": device_name(args.device),
        "elapsed_s": time.perf_counter() - started,
        "scale": args.scale,
        "workload": dataclasses.asdict(work),
        "engine": engine_flags(args, work, hicache=True),
        "results": rows,
        "speedup": ratios,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
