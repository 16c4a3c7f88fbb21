"""Jump-forward against decoding without it, on a schema of long fixed keys, in one call.

    python3 benchmarks/gpu/jump_forward_ab.py --out OUT.json [--batches 1,8,32] [--rounds 2]
        [--variants base,jf,host,lead,chain] [-- STEP_PROFILE_FLAGS ...]

Every variant is one ``step_profile.py --grammar keys --window request --step-trace`` run: whole
requests, prefill included, the same requests each time. ``base`` decodes without jump-forward;
``jf`` turns it on (chain launches on CUDA, host jumps on the CPU); ``host`` takes forced text on
the host (``PHLOEM_JUMP_CHAIN=0``); ``lead`` adds ``PHLOEM_JUMP_LEAD=1`` to that; ``chain`` asks
for chain launches of 8 nodes a row (``PHLOEM_JUMP_CHAIN=8``) on any device. A round runs every
variant of a batch size in turn, so a slow stretch of a noisy host falls on all of them, and each
variant's ratio is taken against ``base`` of the same round. The figure is whole records a second
(jump-forward writes forced text in fewer tokens than the model picks, so tokens a second
undersell it); characters a second follow it.

Flags after ``--`` go to every ``step_profile.py`` run after the defaults (later ones win), e.g.
``--real-model -- --device cpu --dtype float32 --cpu-overlap --decode-steps 8 --grammar-on-device
on`` on the CPU. Only ``OUT.json`` is written (each run's own file goes to a temporary folder): one
file per call.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
# dummy weights of the default shape and the tokenizer folder the GPU setup carries (--real-model:
# step_profile's own default, the embedded model)
DUMMY = ["--load-format", "dummy", "--tokenizer-path", ".gputok"]
DEFAULTS = [
    "--no-torch-profile", "--input-len", "128", "--max-new-tokens", "128", "--grammar", "keys",
    "--window", "request", "--step-trace",
]  # fmt: skip
VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "base": ([], {}),
    "jf": (["--jump-forward"], {}),
    "host": (["--jump-forward"], {"PHLOEM_JUMP_CHAIN": "0"}),
    "lead": (["--jump-forward"], {"PHLOEM_JUMP_CHAIN": "0", "PHLOEM_JUMP_LEAD": "1"}),
    "chain": (["--jump-forward"], {"PHLOEM_JUMP_CHAIN": "8"}),
}
SWITCHES = ("PHLOEM_JUMP_LEAD", "PHLOEM_JUMP_CHAIN")


def repeats_for(batch: int) -> int:
    """Windows a run merges: a batch-1 window of one record is a few tens of milliseconds."""
    return 5 if batch == 1 else 3


def launch_shape(trace: list[list[Any]]) -> dict[str, Any]:
    """What the decode launches of a ``--step-trace`` carried: how many, how many led by a jump
    (``D`` rows whose longest extend exceeds 1), and the steps a launch as ``{steps: count}``."""
    decodes = [row for row in trace if row[1] == "D"]
    steps = collections.Counter(row[3] for row in decodes)
    return {
        "decode_launches": len(decodes),
        "lead_launches": sum(row[4] > 1 for row in decodes),
        "steps_per_launch": {str(k): steps[k] for k in sorted(steps)},
    }


def row_of(variant: str, batch: int, round_: int, result: dict[str, Any]) -> dict[str, Any]:
    """One run's figures from its ``step_profile`` output."""
    t = result["timing"]
    return {
        "variant": variant, "batch": batch, "round": round_,
        "requests_per_s": round(t["requests_per_s"], 2), "chars_per_s": round(t["chars_per_s"], 1),
        "tok_s": round(t["tok_s"], 1), "decode_tokens": t["decode_tokens"], "steps": t["steps"],
        "jump_forward_tokens": t["jump_forward_tokens"], "jump_stale_tokens": t["jump_stale_tokens"],
        "chain_forced_tokens": t.get("chain_forced_tokens", 0),
        "pace_step_ms": round(t.get("pace_step_ms", 0.0), 3),
        "grammar_rejected": t["grammar_rejected"], "finish_kinds": t["finish_kinds"],
        **launch_shape(t.get("step_trace") or []),
    }  # fmt: skip


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per batch and variant: its records a second in each round, its ratio to ``base`` of the
    same round, and the median of those ratios (None without a ``base`` in that round)."""
    base = {(r["batch"], r["round"]): r["requests_per_s"] for r in rows if r["variant"] == "base"}
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        entry = out.setdefault(f"batch {r['batch']}", {}).setdefault(
            r["variant"], {"requests_per_s": [], "ratio_to_base": []}
        )
        entry["requests_per_s"].append(r["requests_per_s"])
        ref = base.get((r["batch"], r["round"]))
        entry["ratio_to_base"].append(round(r["requests_per_s"] / ref, 3) if ref else None)
    for variants in out.values():
        for entry in variants.values():
            ratios = [x for x in entry["ratio_to_base"] if x is not None]
            entry["median_ratio"] = round(statistics.median(ratios), 3) if ratios else None
    return out


def command(variant: str, batch: int, extra: list[str], out: str, *, dummy: bool = True) -> list[str]:
    """The ``step_profile.py`` command line of one run."""
    return [sys.executable, os.path.join(HERE, "step_profile.py"), *(DUMMY if dummy else []), *DEFAULTS,
            "--batch", str(batch), "--repeats", str(repeats_for(batch)), *VARIANTS[variant][0], *extra,
            "--out", out]  # fmt: skip


def run_one(
    variant: str, batch: int, extra: list[str], folder: str, timeout: int, *, dummy: bool
) -> dict[str, Any] | None:
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}  # only the variant's switches
    env.update(VARIANTS[variant][1])
    path = os.path.join(folder, f"{variant}_{batch}.json")
    cmd = command(variant, batch, extra, path, dummy=dummy)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        print(f"{variant} batch {batch} failed:\n{done.stderr[-2000:]}", file=sys.stderr, flush=True)
        return None
    with open(path) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--timeout", type=int, default=120, help="seconds one run may take")
    p.add_argument("--real-model", action="store_true", help="the embedded model, not dummy weights")
    args, extra = p.parse_known_args()
    extra = [x for x in extra if x != "--"]
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            for batch in (int(b) for b in args.batches.split(",")):
                for variant in variants:
                    result = run_one(variant, batch, extra, folder, args.timeout, dummy=not args.real_model)
                    if result is None:
                        continue
                    rows.append(row_of(variant, batch, round_, result))
                    r = rows[-1]
                    print(f"round {round_} batch {batch:3d} {variant:11s} records/s {r['requests_per_s']:8.2f} "
                          f"chars/s {r['chars_per_s']:9.1f} launches {r['decode_launches']:3d} (lead "
                          f"{r['lead_launches']}) steps {r['steps_per_launch']} rejected {r['grammar_rejected']}",
                          flush=True)  # fmt: skip
    commit = (
        os.environ.get("GIT_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    summary = summarize(rows)
    print(json.dumps(summary, indent=1))
    with open(args.out, "w") as f:
        json.dump(
            {"git_commit": commit, "date": datetime.date.today().isoformat(), "device": _device(),
             "defaults": (DUMMY if not args.real_model else []) + DEFAULTS, "extra": extra, "summary": summary, "runs": rows},
            f, indent=1,
        )  # fmt: skip


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "unknown"


if __name__ == "__main__":
    main()
