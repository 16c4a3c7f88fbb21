"""The overlap loop on the CPU, on and off: Engine decode at batch 1 (docs/design.md §5).

    python -m phloem.bench.cpu_overlap [--rounds 2] [--prompts 6] [--max-new-tokens 48]

On the CPU the model and the scheduler share the same cores, so the overlap loop's worker thread
buys no parallel device; this measures what it costs. Each round starts one Engine per setting
(default = inline loop, then ``enable_cpu_overlap_schedule=True``), sends the held-out prompts of
the EAGLE training file one at a time (greedy, ``ignore_eos``) after a short warm-up, and prints
output tokens per second. Settings alternate, so a shared machine's load shifts hit both alike.
"""

from __future__ import annotations

import argparse
import time


def _tok_s(overlap: bool, prompts: list[str], max_new: int) -> float:
    from phloem import Engine

    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    with Engine(device="cpu", dtype="float32", enable_cpu_overlap_schedule=overlap, log_level="warning",
                max_running_requests=1) as eng:  # fmt: skip
        eng.generate([prompts[0]], sampling_params={**params, "max_new_tokens": 8})
        t = time.perf_counter()
        tokens = sum(
            eng.generate([p], sampling_params=params)[0]["meta_info"]["completion_tokens"] for p in prompts
        )
        return tokens / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    from phloem.training.eagle_head import DEFAULT_PROMPTS, read_prompts

    p = argparse.ArgumentParser(prog="phloem bench cpu_overlap", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    prompts = read_prompts(DEFAULT_PROMPTS)[: args.prompts]
    for r in range(args.rounds):
        for overlap in (False, True):
            print(f"round {r + 1}, overlap {'on ' if overlap else 'off'}: "
                  f"{_tok_s(overlap, prompts, args.max_new_tokens):.1f} tok/s", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
