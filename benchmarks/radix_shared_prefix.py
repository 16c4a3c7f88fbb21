"""Engine-core benchmark: a shared-prefix workload with the radix cache on, off, and in transformers.

Workload (``--scale 1``): 64 requests in 4 groups of 16; each group shares a 1,024-token system
prompt, then a 32-token question; 64 output tokens (``ignore_eos``, greedy); 8 requests in flight.
The same prompts run through

- phloem's in-process Engine with the radix cache (default flags),
- the same Engine with ``disable_radix_cache=True``,
- Hugging Face ``generate`` on the same GGUF (fp32, greedy, batches of 8, left padding,
  ``min_new_tokens`` = ``max_new_tokens`` so every row makes the same number of tokens).

Prints a table and writes ``benchmarks/results/cpu/radix_shared_prefix.json`` (command, git commit,
date, machine, per-system results).

    python benchmarks/radix_shared_prefix.py              # full size
    python benchmarks/radix_shared_prefix.py --scale 0.25 # quick check
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

from phloem.bench.client import EngineBackend
from phloem.bench.datasets import DatasetOptions, Session, TextMaker, shared_prefix_dataset
from phloem.bench.runner import RunOptions, run_sessions
from phloem.bench.serving import warm_up

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "cpu", "radix_shared_prefix.json")


@dataclasses.dataclass(frozen=True)
class Workload:
    num_groups: int = 4
    prompts_per_group: int = 16
    prefix_len: int = 1024
    question_len: int = 32
    output_len: int = 64
    in_flight: int = 8

    @classmethod
    def scaled(cls, scale: float) -> Workload:
        """Shrinks prompts per group, prefix and output lengths (groups, question, in-flight stay)."""
        full = cls()
        return cls(
            prompts_per_group=max(2, round(full.prompts_per_group * scale)),
            prefix_len=max(64, round(full.prefix_len * scale)),
            output_len=max(8, round(full.output_len * scale)),
        )

    @property
    def num_requests(self) -> int:
        return self.num_groups * self.prompts_per_group

    def dataset_options(self) -> DatasetOptions:
        return DatasetOptions(
            num_groups=self.num_groups,
            prompts_per_group=self.prompts_per_group,
            prefix_len=self.prefix_len,
            question_len=self.question_len,
            output_len=self.output_len,
        )


# ---- phloem --------------------------------------------------------------------------------------
def run_phloem(work: Workload, **engine_flags: Any) -> dict[str, Any]:
    """One Engine, one warm-up request, then the whole workload with ``in_flight`` requests at a time."""
    from phloem import Engine

    engine = Engine(log_level="warning", **engine_flags)
    try:
        return asyncio.run(_phloem_workload(engine, work))
    finally:
        engine.shutdown()


async def _phloem_workload(engine: Any, work: Workload) -> dict[str, Any]:
    tok = engine.tm.tokenizer
    sessions = shared_prefix_dataset(TextMaker(tok), work.dataset_options())
    backend = EngineBackend(engine)
    await warm_up(backend, tok, 1)
    results, wall = await run_sessions(
        backend, sessions, tok, RunOptions(max_concurrency=work.in_flight, progress=False)
    )
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
    out_tokens = sum(r.server_output_tokens or 0 for r in results)
    prompt = sum(r.server_prompt_tokens or 0 for r in results)
    return {
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "mean_ttft_ms": 1000 * sum(r.ttft for r in results) / len(results),
        "cache_hit_rate": sum(r.cached_tokens or 0 for r in results) / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
    }


# ---- transformers --------------------------------------------------------------------------------
class FirstStepClock:
    """A logits processor that notes when ``generate`` finished its prefill (first call)."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if self.first is None:
            self.first = time.perf_counter()
        return scores


def run_hf(work: Workload, sessions: list[Session], tok: Any) -> dict[str, Any]:
    import torch
    from phloem.runtime.model_files import resolve_model
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    path = resolve_model(None).path
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    prompts = [tok.encode(s.turns[0].content) for s in sessions]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ttfts, out_tokens, start = [], 0, time.perf_counter()
    for i in range(0, len(prompts), work.in_flight):
        batch = prompts[i : i + work.in_flight]
        ids, mask = left_pad(batch, pad)
        clock, t0 = FirstStepClock(), time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=torch.tensor(ids),
                attention_mask=torch.tensor(mask),
                max_new_tokens=work.output_len,
                min_new_tokens=work.output_len,
                do_sample=False,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([clock]),
            )
        ttfts += [(clock.first or time.perf_counter()) - t0] * len(batch)
        out_tokens += (out.shape[1] - len(ids[0])) * len(batch)
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "mean_ttft_ms": 1000 * sum(ttfts) / len(ttfts),
        "cache_hit_rate": None,
        "prompt_tokens": sum(len(p) for p in prompts),
    }


def left_pad(rows: list[list[int]], pad: int) -> tuple[list[list[int]], list[list[int]]]:
    width = max(len(r) for r in rows)
    ids = [[pad] * (width - len(r)) + r for r in rows]
    mask = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
    return ids, mask


# ---- report --------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def format_table(results: dict[str, dict[str, Any]]) -> str:
    head = f"{'system':<22}{'wall s':>9}{'out tok/s':>11}{'mean TTFT ms':>14}{'cache hit':>11}"
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        hit = "-" if r["cache_hit_rate"] is None else f"{r['cache_hit_rate']:.3f}"
        lines.append(
            f"{name:<22}{r['wall_s']:>9.1f}{r['output_tok_s']:>11.1f}{r['mean_ttft_ms']:>14.0f}{hit:>11}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0, help="shrink the workload (0.25 for a quick check)")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--output", default=RESULTS, help="JSON results path")
    ns = p.parse_args(argv)
    work = Workload.scaled(ns.scale) if ns.scale != 1.0 else Workload()
    print(f"workload: {dataclasses.asdict(work)}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    results["phloem radix"] = run_phloem(work)
    print(format_table(results), flush=True)
    results["phloem no radix"] = run_phloem(work, disable_radix_cache=True)
    print(format_table(results), flush=True)
    if not ns.skip_hf:
        from phloem.runtime.model_files import resolve_model
        from phloem.runtime.tokenizer.tokenizer import load_tokenizer

        tok = load_tokenizer(resolve_model(None))
        sessions = shared_prefix_dataset(TextMaker(tok), work.dataset_options())
        results["transformers generate"] = run_hf(work, sessions, tok)
    table = format_table(results)
    print(table)
    record = {
        "command": " ".join(
            ["python", "benchmarks/radix_shared_prefix.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "workload": dataclasses.asdict(work),
        "scale": ns.scale,
        "results": results,
        "table": table.splitlines(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(ns.output)), exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {ns.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
