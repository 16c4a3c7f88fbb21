"""Where the GPU waits for the host: idle gaps of a torch-profiler trace and the host code behind them.

    python3 benchmarks/gpu/step_profile.py --window prefill ... --keep-trace [--trace-stacks] --out F.json
    python -m benchmarks.gpu.trace_gaps F.trace.json.gz [--min-gap-us 50] [--top 15]

With Python stacks in the trace (``step_profile.py --keep-trace --trace-stacks``) gaps are named
by host code; without them (the host runs at full speed) by the launching thread. For every gap
between GPU activity (kernels, copies, memsets) of at least ``--min-gap-us``, the kernel that ends
the gap is followed back to its launch (``correlation`` ids) and the host thread that launched it:

- ``late``: how long after the gap opened the launch call began. Close to the whole gap means the
  GPU waited for that launch; the host was elsewhere until then.
- the Python frames of project code (``phloem``/``runtime``/``benchmarks`` paths) that thread was
  in when the gap opened, and when it issued the launch.

Gaps are then summed by the innermost project frame at the gap's start (or the thread and call),
which names the host work the GPU waited for. Needs only the standard library: it runs anywhere the trace is copied to.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import Counter, defaultdict
from typing import Any

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # Triton launches through the driver API
_OURS = ("runtime/", "phloem/", "benchmarks/", "lang/", "grammars/")
_NOT_OURS = ("site-packages", "dist-packages", "/usr/lib/")  # triton/runtime/... is not ours


def load(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def gpu_gaps(events: list[dict[str, Any]], min_gap: float) -> list[tuple[float, float, dict[str, Any]]]:
    """``(start, end, event that ends the gap)`` for every GPU idle gap of ``min_gap`` us or more."""
    gpu = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in _GPU_CATS), key=lambda e: e["ts"]
    )
    out, cur_end = [], None
    for e in gpu:
        if cur_end is not None and e["ts"] - cur_end >= min_gap:
            out.append((cur_end, e["ts"], e))
        end = e["ts"] + e.get("dur", 0)
        cur_end = end if cur_end is None else max(cur_end, end)
    return out


class Stacks:
    """Python frames per thread, queried by time: the frames that contain an instant."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.by_tid: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)
        for e in events:
            if e.get("ph") == "X" and e.get("cat") == "python_function":
                self.by_tid[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
        self.starts: dict[Any, list[float]] = {}
        for tid, frames in self.by_tid.items():
            frames.sort()
            self.starts[tid] = [f[0] for f in frames]

    def at(self, tid: Any, t: float) -> list[str]:
        """Project frames containing ``t`` on ``tid``, outermost first."""
        frames = self.by_tid.get(tid, [])
        i = bisect.bisect_right(self.starts.get(tid, []), t)
        hits = [f for f in frames[:i] if f[1] >= t]  # frames are few enough per thread for a scan
        hits.sort(key=lambda f: (f[0], -f[1]))
        return [_short(f[2]) for f in hits if _ours(f[2])]


def _ours(name: str) -> bool:
    return any(k in name for k in _OURS) and not any(k in name for k in _NOT_OURS)


def _short(name: str) -> str:
    for k in _OURS:
        i = name.find(k)
        if i >= 0:
            return name[i:]
    return name


def launches(events: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """Host runtime calls (launches, copies) by correlation id."""
    out = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {}):
            out[e["args"]["correlation"]] = e
    return out


def analyse(path: str, min_gap: float, top: int) -> dict[str, Any]:
    events = load(path)
    gaps = gpu_gaps(events, min_gap)
    calls = launches(events)
    stacks = Stacks(events)
    rows, by_frame = [], defaultdict(lambda: [0.0, 0])
    for start, end, nxt in gaps:
        call = calls.get(nxt.get("args", {}).get("correlation"))
        tid = call["tid"] if call else None
        late = (call["ts"] - start) if call else None
        at_gap = stacks.at(tid, start) if call else []
        at_launch = stacks.at(tid, call["ts"]) if call else []
        # without Python stacks in the trace: the launching thread and the call it made
        key = at_gap[-1] if at_gap else f"thread {tid}: {call['name'] if call else '?'}"
        by_frame[key][0] += end - start
        by_frame[key][1] += 1
        rows.append({
            "gap_us": round(end - start, 1), "next": nxt["name"][:60],
            "launch": call["name"] if call else None, "late_us": None if late is None else round(late, 1),
            "at_gap": at_gap[-4:], "at_launch": at_launch[-4:],
        })  # fmt: skip
    rows.sort(key=lambda r: -r["gap_us"])
    total = sum(r["gap_us"] for r in rows)
    frames = sorted(((k, round(v[0], 1), v[1]) for k, v in by_frame.items()), key=lambda x: -x[1])
    # torch ops and CUDA calls per thread, to tell them apart
    ops: dict[Any, Counter[str]] = defaultdict(Counter)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", *_LAUNCH_CATS):
            ops[e["tid"]][e["name"]] += 1
    threads = {str(tid): [n for n, _ in c.most_common(4)] for tid, c in ops.items()}
    return {
        "gaps": len(rows),
        "gap_us_total": round(total, 1),
        "by_frame": frames[:top],
        "largest": rows[:top],
        "threads": threads,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--min-gap-us", type=float, default=50.0)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", default=None, help="also write the result as JSON")
    args = p.parse_args()
    res = analyse(args.trace, args.min_gap_us, args.top)
    print(f"{res['gaps']} gaps of >= {args.min_gap_us:g} us, {res['gap_us_total'] / 1e3:.2f} ms in all")
    print("\nsummed by the innermost project frame of the launching thread when the gap opened:")
    for frame, us, n in res["by_frame"]:
        print(f"  {us / 1e3:8.2f} ms  {n:4d}  {frame}")
    print("\nthreads (their most frequent torch ops and CUDA calls):")
    for tid, names in res["threads"].items():
        print(f"  {tid}: {', '.join(names)}")
    print("\nlargest gaps:")
    for r in res["largest"]:
        print(f"  {r['gap_us']:8.1f} us  next {r['next']}  launched {r['late_us']} us into the gap")
        print(f"      at gap:    {' > '.join(r['at_gap'])}")
        print(f"      at launch: {' > '.join(r['at_launch'])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
