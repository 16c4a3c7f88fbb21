"""Where a run's time went, step by step, from the scheduler's own log (any device).

    python -m phloem.bench.offline ... --log-level info --log-interval 1 > run.log 2>&1
    python -m phloem.bench.step_timeline run.log [--json F]

With ``--log-interval 1`` the scheduler logs every prefill pass and every decode step with a
millisecond timestamp, the number of running requests and the KV tokens they hold. This reads
those lines and splits the run in two phases:

- prefill: from the first prefill pass after the warm-up request to the last one (decode steps
  interleaved with it count here);
- decode: every step after the last prefill pass, grouped by running batch size (bins of 32),
  with the mean time per step, the mean context per request and the tokens per second.

A step's time is the gap to the next logged line, so one slow step (a kernel compiled on first
use, a collection pause) shows up in its bin; ``--json`` also lists the slowest gaps. A launch of
several decode steps (continuous decode) logs one line with ``#steps: K``: the gap that ends at
that line is what its launch took (the overlap loop launched it before processing the one
before), so it counts as ``K`` steps.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import Any

_LINE = re.compile(
    r"\[(\S+ \S+) scheduler\] (Prefill|Decode) batch\. "
    r"#(?:new-seq|running-req): (\d+), #(?:new-token|token): (\d+)"
)
_STEPS = re.compile(r"#steps: (\d+)")
BIN = 32


@dataclass
class Event:
    t: float  # seconds (epoch)
    kind: str  # "Prefill" | "Decode"
    count: int  # new sequences (prefill) or running requests (decode)
    tokens: int  # new tokens (prefill) or KV tokens held (decode)
    steps: int = 1  # decode steps of the launch this line reports


def parse(lines: list[str]) -> list[Event]:
    events = []
    for line in lines:
        m = _LINE.search(line)
        if m:
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            k = _STEPS.search(line)
            events.append(Event(t, m.group(2), int(m.group(3)), int(m.group(4)), int(k.group(1)) if k else 1))
    return events


def timeline(events: list[Event]) -> dict[str, Any]:
    """Phase durations, per-batch-size decode figures and the slowest gaps of one run."""
    prefills = [i for i, e in enumerate(events) if e.kind == "Prefill"]
    if len(prefills) < 2:
        raise ValueError("fewer than two prefill passes logged: was --log-interval 1 set?")
    first, last = prefills[1], prefills[-1]  # prefills[0]: the benchmark's warm-up request
    decode = [e for e in events[last + 1 :] if e.kind == "Decode"]
    bins: dict[int, list[float]] = {}  # low edge -> [steps, seconds, requests, kv tokens]
    for a, b in zip(decode, decode[1:]):
        acc = bins.setdefault(a.count // BIN * BIN, [0, 0.0, 0, 0])
        acc[0] += b.steps
        acc[1] += b.t - a.t
        acc[2] += a.count * b.steps
        acc[3] += a.tokens * b.steps
    rows = [
        {
            "batch": f"{lo}-{lo + BIN - 1}",
            "steps": int(n),
            "seconds": round(s, 3),
            "ms_per_step": round(1e3 * s / n, 2),
            "mean_context": round(tok / req) if req else 0,
            "tok_s": round(req / s) if s else 0,
        }
        for lo, (n, s, req, tok) in sorted(bins.items())
    ]
    run = events[first:]
    gaps = sorted(
        ((b.t - a.t, a.kind, a.count) for a, b in zip(run, run[1:])), key=lambda g: g[0], reverse=True
    )
    return {
        "prefill_seconds": round(events[last].t - events[first].t, 3),
        "prefill_passes": len(prefills) - 1,
        "decode_seconds": round(decode[-1].t - decode[0].t, 3) if decode else 0.0,
        "decode_steps": sum(e.steps for e in decode),
        "decode_by_batch": rows,
        "slowest_gaps": [{"ms": round(1e3 * g, 1), "after": k, "count": c} for g, k, c in gaps[:5]],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", help="stderr of a run with --log-level info --log-interval 1")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    with open(args.log) as f:
        result = timeline(parse(f.readlines()))
    print(f"prefill phase {result['prefill_seconds']:.3f} s over {result['prefill_passes']} passes; "
          f"decode phase {result['decode_seconds']:.3f} s over {result['decode_steps']} steps")  # fmt: skip
    print(f"{'batch':>9} {'steps':>6} {'s':>7} {'ms/step':>8} {'mean ctx':>9} {'tok/s':>8}")
    for r in result["decode_by_batch"]:
        print(f"{r['batch']:>9} {r['steps']:>6} {r['seconds']:>7.3f} {r['ms_per_step']:>8.2f} "
              f"{r['mean_context']:>9} {r['tok_s']:>8}")  # fmt: skip
    print("slowest gaps:", ", ".join(f"{g['ms']} ms after {g['after']}" for g in result["slowest_gaps"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python -m phloem.bench.step_timeline " + " ".join(argv or sys.argv[1:]),
                       **result}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
