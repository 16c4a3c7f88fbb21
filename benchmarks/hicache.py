"""Hierarchical cache benchmark: shared system prompts that outnumber the device pool.

Workload (``--scale 1``): groups of 8 users; the users of a group share a 2,048-token system prompt,
then ask a 32-token question; 32 output tokens (``ignore_eos``, greedy); 8 requests in flight. Users
arrive in random order (``--order random``, seeded) or round-robin over the groups (user 0 of every
group, then user 1 of every group, ...). The device KV pool holds about 11 prompts, so with more
groups the radix cache alone has often evicted a prompt before it is reused; with
``--enable-hierarchical-cache`` (host pool 2x the device pool) it comes back from the host.

What to expect from LRU tiers: ``write_through`` keeps device content on the host too, so device
and host together hold ~22 prompts; ``write_back`` keeps them apart (~33 prompts). A strictly
cyclic order over more groups than fit gets no hits from any LRU cache; a random order gets the
fraction that fits.

For each number of groups (default 8, 32, 64) the same requests run through an Engine without and
with the hierarchical cache; the table shows mean TTFT, output and total token throughput, the share
of prompt tokens served from cache, and how many came from the host tier.

    python benchmarks/hicache.py                       # full size (slow on a CPU)
    python benchmarks/hicache.py --scale 0.125 --groups 8,16,32

``--scale`` shrinks the system prompt, question and output lengths (and with them the device pool,
which stays at ~11 prompts); the group size and the shape of the workload stay. Results go to
``benchmarks/results/hicache.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import random
import sys
from typing import Any

from phloem.bench.client import EngineBackend
from phloem.bench.datasets import DatasetOptions, Session, TextMaker, shared_prefix_dataset
from phloem.bench.runner import RunOptions, run_sessions
from phloem.bench.serving import warm_up

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "hicache.json")


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

    def sessions(self, tokenizer: Any, groups: int) -> list[Session]:
        """Round-robin over groups (user u of group g is request ``u * groups + g``) or shuffled."""
        opts = DatasetOptions(num_groups=groups, prompts_per_group=self.users_per_group,
                              prefix_len=self.prefix_len, question_len=self.question_len,
                              output_len=self.output_len)  # fmt: skip
        by_group = shared_prefix_dataset(TextMaker(tokenizer), opts)
        order = [
            by_group[g * self.users_per_group + u] for u in range(self.users_per_group) for g in range(groups)
        ]
        if self.order == "random":
            random.Random(1).shuffle(order)
        return [dataclasses.replace(s, sid=i) for i, s in enumerate(order)]


def run_one(work: Workload, groups: int, *, hicache: bool) -> dict[str, Any]:
    from phloem import Engine

    flags: dict[str, Any] = {"max_total_tokens": work.pool_tokens}
    if hicache:
        flags["enable_hierarchical_cache"] = True
        flags["hicache_write_policy"] = work.write_policy
    engine = Engine(log_level="warning", **flags)
    try:
        return asyncio.run(_workload(engine, work, groups))
    finally:
        engine.shutdown()


async def _workload(engine: Any, work: Workload, groups: int) -> dict[str, Any]:
    tok = engine.tm.tokenizer
    sessions = work.sessions(tok, groups)
    backend = EngineBackend(engine)
    await warm_up(backend, tok, 1)
    results, wall = await run_sessions(
        backend, sessions, tok, RunOptions(max_concurrency=work.in_flight, progress=False)
    )
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
    live = engine.get_server_info()["live"]
    out_tokens = sum(r.server_output_tokens or 0 for r in results)
    prompt = sum(r.server_prompt_tokens or 0 for r in results)
    return {
        "requests": len(results),
        "wall_s": wall,
        "mean_ttft_ms": 1000 * sum(r.ttft for r in results) / len(results),
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + prompt) / wall,
        "cache_hit_rate": sum(r.cached_tokens or 0 for r in results) / prompt if prompt else 0.0,
        "host_hit_tokens": live.get("hicache_host_hit_tokens", 0),
        "prompt_tokens": prompt,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'groups':>7}{'hicache':>9}{'reqs':>6}{'wall s':>9}{'mean TTFT ms':>14}{'out tok/s':>11}"
            f"{'total tok/s':>13}{'cache hit':>11}{'host hits':>11}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['groups']:>7}{'on' if r['hicache'] else 'off':>9}{r['requests']:>6}{r['wall_s']:>9.1f}"
            f"{r['mean_ttft_ms']:>14.0f}{r['output_tok_s']:>11.1f}{r['total_tok_s']:>13.0f}"
            f"{r['cache_hit_rate']:>10.0%}{r['host_hit_tokens']:>11}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="shrink prompt, question and output lengths")
    ap.add_argument("--groups", default="8,32,64", help="comma-separated numbers of groups")
    ap.add_argument("--users", type=int, default=8, help="users per group")
    ap.add_argument("--order", default="random", choices=["random", "roundrobin"], help="arrival order")
    ap.add_argument(
        "--write-policy", default="write_through", help="--hicache-write-policy of the HiCache runs"
    )
    ap.add_argument("--no-save", action="store_true", help="do not write the results file")
    args = ap.parse_args(argv)
    work = dataclasses.replace(
        Workload.scaled(args.scale),
        users_per_group=args.users,
        order=args.order,
        write_policy=args.write_policy,
    )
    print(f"workload: {work} device pool {work.pool_tokens} tokens (scale {args.scale})", flush=True)
    rows = []
    for groups in (int(g) for g in args.groups.split(",")):
        for hicache in (False, True):
            r = {"groups": groups, "hicache": hicache, **run_one(work, groups, hicache=hicache)}
            rows.append(r)
            print(format_table([r]).splitlines()[-1], flush=True)
    print(format_table(rows))
    if not args.no_save:
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "w") as f:
            json.dump({"command": " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "scale": args.scale, "workload": dataclasses.asdict(work), "results": rows}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
