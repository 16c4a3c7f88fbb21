"""EAGLE accept length over a sweep of draft-tree shapes, greedy, at batch 1 on CPU (docs/design.md §7).

    python -m phloem.bench.spec_tree_sweep --configs "4,1,5;4,4,8;6,4,16" --max-new-tokens 64

Each config is ``num_steps,topk,num_draft_tokens`` (``num_draft_tokens`` counts the root, as in
:class:`~phloem.runtime.speculative.eagle.EagleDraftWorker`). The target runs in float32 on the
CPU; the prompts are the draft head's held-out prompts (the first ``--prompts`` lines of its
training file, chat-templated), decoded one at a time to ``--max-new-tokens`` or EOS, as
:func:`~phloem.training.eagle_head.evaluate_acceptance` does. Configs run one after another;
the JSON at ``--out`` is rewritten after each, so an interrupted sweep keeps what it finished.

Per config: mean accept length (tokens per verify, over all verifies of all prompts), the mean
number of draft tokens verified per step (tree nodes minus the root), wall time per step (draft +
verify + catch-up) and of the verify pass alone, and each prompt's own accept length. Greedy
decoding must give the same tokens whatever the tree, so ``same_tokens_as_first`` flags a config
whose output differs from the first config's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from typing import Any

from phloem.bench.grammar_decode import git_commit
from phloem.runtime.speculative.decoding import EagleDrafter

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu", "spec_tree_sweep.json")
DEFAULT_CONFIGS = "4,1,5;6,1,7;4,4,8;4,4,16;5,4,16;6,4,16;5,8,16;6,8,32;8,4,32;5,4,24"


class CountingDrafter(EagleDrafter):
    """An :class:`EagleDrafter` that remembers how many draft tokens each proposed tree holds."""

    def __init__(self, worker: Any) -> None:
        super().__init__(worker)
        self.sizes: list[int] = []

    def propose_many(self, seqs: list[int], contexts: list[list[int]]) -> list[Any]:
        trees = super().propose_many(seqs, contexts)
        self.sizes += [len(t) - 1 for t in trees]
        return trees


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in text.split(";"):
        if part.strip():
            steps, topk, tokens = (int(x) for x in part.split(","))
            out.append((steps, topk, tokens))
    return out


def sweep_config(
    runner: Any, head: Any, prompts: list[list[int]], stop: set[int], cfg: tuple[int, int, int], max_new: int
) -> tuple[dict[str, Any], list[list[int]]]:
    """Decode every prompt with one tree shape; returns the config's row and the output tokens."""
    from phloem.runtime.speculative.decoding import SpeculativeDecoder
    from phloem.runtime.speculative.eagle import EagleDraftWorker

    steps, topk, tokens = cfg
    worker = EagleDraftWorker.for_runner(head, runner, num_steps=steps, topk=topk, num_draft_tokens=tokens)
    drafter = CountingDrafter(worker)
    dec = SpeculativeDecoder(runner, drafter)
    lens: list[int] = []
    per_prompt: list[float] = []
    outputs: list[list[int]] = []
    secs = verify_secs = 0.0
    for p in prompts:
        o = dec.generate([p], max_new, stop_ids=stop)[0]
        lens += o.accept_lengths
        per_prompt.append(o.mean_accept_length)
        outputs.append(o.tokens)
        secs += o.decode_seconds
        verify_secs += o.verify_seconds
    n = max(len(lens), 1)
    row = {
        "num_steps": steps,
        "topk": topk,
        "num_draft_tokens": tokens,
        "effective_num_draft_tokens": worker.num_draft_tokens,  # capped at the tree's node count
        "accept_length": sum(lens) / n,
        "verify_steps": len(lens),
        "generated_tokens": sum(len(t) for t in outputs),
        "draft_tokens_per_step": sum(drafter.sizes) / max(len(drafter.sizes), 1),
        "ms_per_step": 1e3 * secs / n,
        "ms_verify_per_step": 1e3 * verify_secs / n,
        "per_prompt_accept_length": per_prompt,
    }
    return row, outputs


def main(argv: list[str] | None = None) -> int:
    from phloem.bench.speculative import cpu_target
    from phloem.runtime.speculative import DEFAULT_EAGLE_HEAD
    from phloem.runtime.speculative.eagle import load_eagle_head

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="num_steps,topk,num_draft_tokens;...")
    p.add_argument("--model", default=None, help="target (default: the default model)")
    p.add_argument("--head", default=DEFAULT_EAGLE_HEAD, help="EAGLE head .safetensors")
    p.add_argument("--prompts", type=int, default=12, help="held-out prompts (first lines of the file)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)

    source, runner, _, stop, prompts = cpu_target(args.model, args.threads, args.prompts)
    head = load_eagle_head(args.head)
    configs = parse_configs(args.configs)
    sweep_config(runner, head, prompts[:1], stop, configs[0], 8)  # warm-up, not recorded

    report: dict[str, Any] = {
        "command": shlex.join(
            ["python", "-m", "phloem.bench.spec_tree_sweep", *(sys.argv[1:] if argv is None else argv)]
        ),
        "commit": git_commit(),
        "model": source.name,
        "head": os.path.relpath(args.head, os.getcwd()),
        "device": "cpu",
        "dtype": "float32",
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "results": [],
    }
    first: list[list[int]] | None = None
    print(f"{'steps,topk,tokens':<18} {'accept len':>10} {'draft tok':>10} {'ms/step':>9} {'ms/verify':>10}")
    for cfg in configs:
        t0 = time.monotonic()
        row, outputs = sweep_config(runner, head, prompts, stop, cfg, args.max_new_tokens)
        first = outputs if first is None else first
        row["same_tokens_as_first"] = outputs == first
        row["wall_seconds"] = round(time.monotonic() - t0, 1)
        report["results"].append(row)
        report["load_average_at_end"] = os.getloadavg()
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        name = ",".join(map(str, cfg))
        print(f"{name:<18} {row['accept_length']:>10.3f} {row['draft_tokens_per_step']:>10.1f} "
              f"{row['ms_per_step']:>9.1f} {row['ms_verify_per_step']:>10.1f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
