"""Where a speculative window step's GPU time goes, from a kept ``step_profile.py`` trace.

    python3 benchmarks/gpu/step_profile.py --batch 1 --spec EAGLE --decode-steps 8 --keep-trace --out F.json
    python3 -m benchmarks.gpu.window_phases F.trace.json.gz [--steps 3]

Windows are the runs of GPU work between idle gaps of 300 us or more (the host reads a window's
tokens between two). Each step of a window is cut at the target's 30-odd layers (the first
tree-verify kernel, the norm of the logits after the last): ``draft`` (the head's chain),
``verify`` (the target's layers over the chain) and ``rest`` (logits, argmax, acceptance, the
head's catch-up). Times run from a phase's first kernel start to the next phase's: with PDL a
kernel's own duration includes its wait for the one before.
"""

from __future__ import annotations

import argparse
import gzip
import json
from typing import Any


def kernels(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    out = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(out, key=lambda e: e["ts"])


def windows(ev: list[dict[str, Any]], gap_us: float = 300.0) -> list[list[dict[str, Any]]]:
    cuts = [0]
    for i in range(1, len(ev)):
        if ev[i]["ts"] - (ev[i - 1]["ts"] + ev[i - 1]["dur"]) > gap_us:
            cuts.append(i)
    cuts.append(len(ev))
    parts = [ev[a:b] for a, b in zip(cuts, cuts[1:])]
    return [p for p in parts if sum("tree_verify" in e["name"] for e in p) >= 2]


def phases(window: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per step of one window: microseconds of draft, verify and rest, and kernel counts."""
    starts = [i for i, e in enumerate(window) if "tree_verify" in e["name"]]
    layers = 1
    while layers < len(starts) and starts[layers] - starts[layers - 1] < starts[1] - starts[0] + 4:
        layers += 1  # tree-verify kernels of one pass sit a few kernels apart; the next step's further
    steps = len(starts) // layers
    per = len(window) // steps
    out = []
    for k in range(1, steps - 1):  # whole steps only (the next step's start ends this one)
        st = window[k * per : (k + 1) * per + 1]
        names = [e["name"] for e in st]
        first = next(i for i, n in enumerate(names) if "tree_verify" in n) - 2  # the qkv projection
        last = max(i for i, n in enumerate(names[:per]) if "tree_verify" in n)
        logits = next(i for i in range(last, per) if "rmsnorm" in names[i])

        def us(a: int, b: int, st: list[dict[str, Any]] = st) -> float:
            return st[b]["ts"] - st[a]["ts"]

        out.append({"draft_us": us(0, first), "verify_us": us(first, logits), "rest_us": us(logits, per),
                    "step_us": us(0, per), "draft_kernels": first, "verify_kernels": logits - first,
                    "rest_kernels": per - logits})  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=3, help="steps printed (of the second window)")
    args = p.parse_args()
    wins = windows(kernels(args.trace))
    rows = [r for w in wins[1:] for r in phases(w)]
    for r in phases(wins[1])[: args.steps]:
        print("  ".join(f"{k} {v:.1f}" if k.endswith("us") else f"{k} {v:d}" for k, v in r.items()))
    if rows:
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
        print(f"mean over {len(rows)} steps: " + "  ".join(f"{k} {v:.1f}" for k, v in mean.items()))


if __name__ == "__main__":
    main()
