"""Cyclic-GC pauses of the scheduler loop, with and without freezing the start-up heap (CPU).

    python -m phloem.bench.gc_pauses [--waves 10] [--batch 64] [--out F]

Builds the scheduler as its process does (default model, CPU), then serves ``--waves`` waves of
``--batch`` requests through ``Scheduler.step`` in this process, recording every collection's
generation and duration with ``gc.callbacks``. Each mode runs in its own child process, so the
two heaps start alike. A full (generation 2) collection stalls every running request for its
whole duration. How often one comes depends on the traffic (objects that outlive younger
collections); ``forced_full_ms`` times one full collection after the waves in each mode.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from typing import Any


def serve(freeze: bool, waves: int, batch: int, new_tokens: int) -> dict[str, Any]:
    from phloem.runtime.config import EngineArgs
    from phloem.runtime.sampling.params import SamplingParams
    from phloem.runtime.sampling.stop import StopChecker
    from phloem.runtime.scheduler.builder import build_scheduler
    from phloem.runtime.scheduler.process import freeze_startup_heap
    from phloem.runtime.scheduler.req import Req

    sched, rt = build_scheduler(
        EngineArgs(device="cpu", max_running_requests=batch, disable_overlap_schedule=True),
        send=lambda m: None,
    )
    frozen = freeze_startup_heap() if freeze else 0
    tracked = len(gc.get_objects())
    pauses: list[tuple[int, float]] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((info["generation"], 1e3 * (time.perf_counter() - started.pop())))

    ids = rt.tokenizer.encode(
        rt.tokenizer.apply_chat_template([{"role": "user", "content": "Name a color."}])
    )
    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    for w in range(waves):
        reqs = []
        for i in range(batch):
            params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            reqs.append(Req(rid=f"w{w}r{i}", origin_input_ids=ids + [i % 50 + 100], params=params,
                            stop_checker=StopChecker(params, eos_token_ids=rt.eos_token_ids)))  # fmt: skip
        for r in reqs:
            sched.add_request(r)
        while not all(r.finished for r in reqs):
            sched.step()
        sched.drain()
    wall = time.perf_counter() - t0
    gc.callbacks.remove(on_gc)
    t1 = time.perf_counter()
    gc.collect()  # what the next full collection would cost the loop now
    forced_ms = 1e3 * (time.perf_counter() - t1)
    full = [ms for g, ms in pauses if g == 2]
    return {
        "freeze": freeze, "frozen_objects": frozen, "tracked_objects": tracked, "seconds": round(wall, 2),
        "collections": len(pauses), "full_collections": len(full),
        "full_max_ms": round(max(full, default=0.0), 2), "full_total_ms": round(sum(full), 2),
        "any_max_ms": round(max((ms for _, ms in pauses), default=0.0), 2),
        "forced_full_ms": round(forced_ms, 2),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--waves", type=int, default=10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=["freeze", "plain"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(serve(args.child == "freeze", args.waves, args.batch, args.new_tokens)))
        return 0
    rows = []
    for mode in ("plain", "freeze"):
        cmd = [sys.executable, "-m", "phloem.bench.gc_pauses", "--child", mode, "--waves", str(args.waves),
               "--batch", str(args.batch), "--new-tokens", str(args.new_tokens)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'mode':7} {'frozen':>8} {'seconds':>8} {'collections':>11} {'full':>5} {'full max ms':>11} "
          f"{'one full collection ms':>22}")  # fmt: skip
    for r in rows:
        print(f"{'freeze' if r['freeze'] else 'plain':7} {r['frozen_objects']:>8} {r['seconds']:>8} "
              f"{r['collections']:>11} {r['full_collections']:>5} {r['full_max_ms']:>11} {r['forced_full_ms']:>22}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m phloem.bench.gc_pauses " + " ".join(argv or sys.argv[1:]),
                       "cpu_count": os.cpu_count(), "results": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
