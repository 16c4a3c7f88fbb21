"""DSL prefix sharing: what a program's request tree saves over sending the same prompts alone.

Two workloads on the in-process Engine (default model):

- tree of thought: a stem, ``fork(8)``, a thought per branch, then ``fork(8)`` inside every branch
  (8 + 64 generations);
- few-shot ``run_batch``: 64 questions after one shared few-shot stem of about 1,500 tokens.

Each runs as a DSL program on an Engine with the radix cache, recording every request the backend
sends (the fork and stem prefills included). Then the same generation prompts go, as independent
concurrent requests, to an Engine started with ``disable_radix_cache=True``. Prefill tokens computed
are ``sum(prompt_tokens - cached_tokens)`` over every request. Generations use ``ignore_eos`` so both
sides decode the same number of tokens.

    python -m benchmarks.lang_prefix_sharing [--batch 64] [--fanout 8] [--stem-tokens 1500]

Writes ``benchmarks/results/cpu/lang_prefix_sharing.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import phloem as ph

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu", "lang_prefix_sharing.json")
GEN_TOKENS = 4


class RecordingBackend(ph.EngineBackend):
    """An EngineBackend that keeps every payload it sends and every response's token counts."""

    def __init__(self, engine: Any):
        super().__init__(engine)
        self.lock = threading.Lock()
        self.generations: list[dict[str, Any]] = []  # payloads that decode (max_new_tokens > 0)
        self.metas: list[dict[str, Any]] = []

    def _send(self, payload: dict[str, Any]) -> Any:
        out = super()._send(payload)
        items = out if isinstance(out, list) else [out]
        with self.lock:
            if payload["sampling_params"].get("max_new_tokens", 1) > 0:
                self.generations.append(payload)
            self.metas.extend(item["meta_info"] for item in items)
        return out


@dataclass
class Side:
    requests: int
    prompt_tokens: int
    prefill_tokens: int
    wall_s: float


def side(metas: list[dict[str, Any]], wall_s: float) -> Side:
    prompt = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m.get("cached_tokens", 0) for m in metas)
    return Side(requests=len(metas), prompt_tokens=prompt, prefill_tokens=prompt - cached, wall_s=wall_s)


# -- workloads ---------------------------------------------------------------------------------------


def tree_of_thought(fanout: int) -> Callable[[ph.Backend], None]:
    topic = (
        "You are planning a community garden for a small town. Consider soil, water, sunlight, "
        "budget, volunteers, tools, seasons, pests, paths, seating, compost and local rules. "
    )

    @ph.function
    def tot(s):
        s += ph.system("You are a careful planner who thinks step by step. " + topic * 6)
        s += ph.user("Propose a plan for the garden. Think of several first steps.")
        firsts = s.fork(fanout)
        for i, first in enumerate(firsts):
            first += f"Thought {i + 1}:" + ph.gen(
                "thought", max_tokens=GEN_TOKENS, temperature=0.8, ignore_eos=True
            )
            seconds = first.fork(fanout)
            for j, second in enumerate(seconds):
                second += f"\nNext step {j + 1}:" + ph.gen(
                    "step", max_tokens=GEN_TOKENS, temperature=0.8, ignore_eos=True
                )
            seconds.join()
        firsts.join()

    def run(backend: ph.Backend) -> None:
        state = tot.run(backend=backend)
        if state.error() is not None:
            raise state.error()

    return run


def few_shot_batch(batch: int, stem_tokens: int) -> Callable[[ph.Backend], None]:
    shot = "Q: What is {a} plus {b}?\nA: {a} plus {b} is {c}.\n\n"
    count = max(1, stem_tokens // 28)  # a shot is about 28 tokens
    stem = "Answer the arithmetic questions.\n\n" + "".join(
        shot.format(a=a, b=a + 3, c=2 * a + 3) for a in range(1, count + 1)
    )

    @ph.function
    def qa(s, a, b):
        s += stem + f"Q: What is {a} plus {b}?\nA:" + ph.gen("answer", max_tokens=GEN_TOKENS, ignore_eos=True)

    def run(backend: ph.Backend) -> None:
        args = [{"a": 1000 + i, "b": 7 * i} for i in range(batch)]
        for state in qa.run_batch(args, backend=backend, num_threads=batch):
            if state.error() is not None:
                raise state.error()

    return run


# -- measuring --------------------------------------------------------------------------------------


def run_shared(engine: Any, workload: Callable[[ph.Backend], None]) -> tuple[Side, list[dict[str, Any]]]:
    engine.flush_cache()
    backend = RecordingBackend(engine)
    start = time.perf_counter()
    workload(backend)
    wall = time.perf_counter() - start
    return side(backend.metas, wall), backend.generations


def run_independent(engine: Any, payloads: list[dict[str, Any]]) -> Side:
    def one(payload: dict[str, Any]) -> dict[str, Any]:
        return engine.generate(payload["text"], sampling_params=payload["sampling_params"])["meta_info"]

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(payloads)) as pool:
        metas = list(pool.map(one, payloads))
    return side(metas, time.perf_counter() - start)


def warm_up(engine: Any) -> None:
    engine.generate("Hello", sampling_params={"max_new_tokens": 2})


def git_commit() -> str:
    try:
        sha = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], check=False).returncode != 0
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="few-shot run_batch size")
    parser.add_argument("--fanout", type=int, default=8, help="branches per fork (the fork is nested once)")
    parser.add_argument("--stem-tokens", type=int, default=1500, help="approximate few-shot stem length")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()

    from phloem import Engine

    workloads = {
        f"tree of thought, fork({args.fanout}) x2": tree_of_thought(args.fanout),
        f"few-shot run_batch x{args.batch}": few_shot_batch(args.batch, args.stem_tokens),
    }
    shared: dict[str, Side] = {}
    payloads: dict[str, list[dict[str, Any]]] = {}
    with Engine(log_level="warning") as engine:
        warm_up(engine)
        for name, workload in workloads.items():
            shared[name], payloads[name] = run_shared(engine, workload)
            print(f"shared      {name}: {shared[name]}", file=sys.stderr)
    independent: dict[str, Side] = {}
    with Engine(log_level="warning", disable_radix_cache=True) as engine:
        warm_up(engine)
        for name in workloads:
            independent[name] = run_independent(engine, payloads[name])
            print(f"independent {name}: {independent[name]}", file=sys.stderr)

    rows = []
    for name in workloads:
        dsl, alone = shared[name], independent[name]
        rows.append(
            {
                "workload": name,
                "dsl": asdict(dsl),
                "independent": asdict(alone),
                "prefill_ratio": dsl.prefill_tokens / alone.prefill_tokens,
                "speedup": alone.wall_s / dsl.wall_s,
            }
        )
    print_table(rows)
    record = {
        "command": " ".join(["python -m benchmarks.lang_prefix_sharing", *sys.argv[1:]]),
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "gen_tokens": GEN_TOKENS,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {args.out}")


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'workload':<30} {'requests':>13} {'prefill tokens (DSL / alone)':>29} {'ratio':>6} "
        f"{'wall s (DSL / alone)':>21} {'speedup':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        d, a = r["dsl"], r["independent"]
        print(
            f"{r['workload']:<30} {d['requests']:>6} / {a['requests']:<4} "
            f"{d['prefill_tokens']:>13,} / {a['prefill_tokens']:<13,} {r['prefill_ratio']:>6.3f} "
            f"{d['wall_s']:>9.1f} / {a['wall_s']:<9.1f} {r['speedup']:>7.1f}x"
        )


if __name__ == "__main__":
    main()
