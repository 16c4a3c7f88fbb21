"""Speculative decoding through the Engine on a GPU: accept length and speedup over plain decoding.

    source benchmarks/gpu/setup_h200.sh install
    python3 benchmarks/gpu/spec_engine.py --model SmolLM2-135M-Instruct.Q4_1.gguf \\
        --head runtime/speculative/assets/smollm2_135m_eagle.safetensors --out $OUT/spec_engine.json

For every configuration (plain decoding, EAGLE chain, EAGLE trees, n-gram) one Engine starts on the
GPU with CUDA graphs on (the same engine, only ``--speculative-*`` differ), and for each batch size
the held-out prompts of the head's training file (chat-templated, repeated to fill the batch) are
generated greedily with ``max_new_tokens`` tokens; batch 1 serves the twelve prompts one after
another. Output tokens/s is the median of ``--repeats`` timed passes (default 3), which follow
identical warm-up calls, each after a flush of the prefix cache; accept length is tokens per
verify over all requests and passes. Outputs are compared with plain decoding token for token
(``match``: the share of requests whose ids are
identical; bf16 verify passes and decode steps may round differently, so this can fall below 1
without a bug: the float32 tests are the correctness check).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {},  # the engine's defaults: continuous decode is auto on CUDA
    "plain-c1": {"num_continuous_decode_steps": 1},
    "eagle-default": {"speculative_algorithm": "EAGLE"},  # the engine's defaults: a chain of 3
    "eagle-chain-1": {"speculative_algorithm": "EAGLE", "speculative_num_steps": 1, "speculative_eagle_topk": 1,
                      "speculative_num_draft_tokens": 2},
    "eagle-chain-4": {"speculative_algorithm": "EAGLE", "speculative_num_steps": 4, "speculative_eagle_topk": 1,
                      "speculative_num_draft_tokens": 5},
    "eagle-tree-8": {"speculative_algorithm": "EAGLE", "speculative_num_steps": 4, "speculative_eagle_topk": 4,
                     "speculative_num_draft_tokens": 8},
    "eagle-tree-16": {"speculative_algorithm": "EAGLE", "speculative_num_steps": 5, "speculative_eagle_topk": 4,
                      "speculative_num_draft_tokens": 16},
    "ngram-2": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 3},
    "ngram-4": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 5},
    # several steps per host sync: continuous decode for plain, windows of chain steps for EAGLE
    "plain-c8": {"num_continuous_decode_steps": 8},
    "eagle-default-w8": {"speculative_algorithm": "EAGLE", "num_continuous_decode_steps": 8},
    "eagle-chain-2-w8": {"speculative_algorithm": "EAGLE", "speculative_num_steps": 2, "speculative_eagle_topk": 1,
                         "speculative_num_draft_tokens": 3, "num_continuous_decode_steps": 8},
    "eagle-chain-4-w8": {"speculative_algorithm": "EAGLE", "speculative_num_steps": 4, "speculative_eagle_topk": 1,
                         "speculative_num_draft_tokens": 5, "num_continuous_decode_steps": 8},
}  # fmt: skip


def _prompts(tokenizer_path: str | None, model: str | None) -> list[str]:
    from phloem.runtime.model_files import resolve_model
    from phloem.runtime.tokenizer.tokenizer import load_tokenizer
    from phloem.training.eagle_head import DEFAULT_PROMPTS, read_prompts

    tok = load_tokenizer(resolve_model(model), tokenizer_path)
    return [
        tok.apply_chat_template([{"role": "user", "content": t}]) for t in read_prompts(DEFAULT_PROMPTS)[:12]
    ]


def _run(engine: Any, prompts: list[str], batch: int, max_new: int, repeats: int = 1) -> dict[str, Any]:
    """One warm-up and ``repeats`` timed passes at ``batch``; ``tok_s`` is the median pass (a
    batch-1 pass is about a second of short requests, so a single pass is noisy). Batch 1 serves every prompt in turn, one request at a time, so
    its accept length covers all the held-out prompts, not the first one only; larger batches
    take the prompts round-robin to fill one ``generate`` call."""
    if batch == 1:
        rounds = [[p] for p in prompts]
    else:
        rounds = [[prompts[i % len(prompts)] for i in range(batch)]]
    params = {"max_new_tokens": max_new, "temperature": 0}
    # warm-up: the same calls, so kernels compiled for this batch's shapes and graphs captured on
    # first use (EAGLE draft graphs per key width) are not timed
    for r in rounds:
        engine.generate(r, sampling_params=params)
    passes: list[tuple[float, list[dict[str, Any]]]] = []
    for _ in range(max(1, repeats)):
        engine.flush_cache()  # the timed calls prefill again (a cached prompt would start EAGLE's draft late)
        outs: list[dict[str, Any]] = []
        t = time.perf_counter()
        for r in rounds:
            outs += engine.generate(r, sampling_params=params)
        passes.append((time.perf_counter() - t, outs))
    rates = [sum(o["meta_info"]["completion_tokens"] for o in outs) / dt for dt, outs in passes]
    metas = [o["meta_info"] for _, outs in passes for o in outs]
    verifies = sum(m.get("spec_verify_ct", 0) for m in metas)
    accepted = sum(m.get("spec_accept_length", 0.0) * m.get("spec_verify_ct", 0) for m in metas)
    accept = accepted / verifies if verifies else 0.0  # tokens per verify over all requests and passes
    dt, outs = passes[0]
    return {"seconds": dt, "output_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
            "tok_s": statistics.median(rates), "tok_s_passes": rates, "requests": len(outs),
            "accept_length": accept, "ids": [o["output_ids"] for o in outs]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--head", default=None, help="EAGLE head (default: the shipped one)")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--repeats", type=int, default=3, help="timed passes per batch size (the median is reported)"
    )
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", help="cuda (cpu: a smoke test)")
    p.add_argument(
        "--quantization", default=None, help="the engine's --quantization (none: a GGUF's float weights)"
    )
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from phloem import Engine

    prompts = _prompts(args.tokenizer_path, args.model)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    results: dict[str, Any] = {}
    plain_ids: dict[int, list[list[int]]] = {}
    for name in args.configs.split(","):
        extra = dict(CONFIGS[name])
        if args.head and extra.get("speculative_algorithm") == "EAGLE":
            extra["speculative_draft_model_path"] = args.head
        t = time.perf_counter()
        with Engine(model_path=args.model, tokenizer_path=args.tokenizer_path, device=args.device, dtype=args.dtype,
                    max_running_requests=max(batches), log_level="warning",
                    **({"quantization": args.quantization} if args.quantization else {}), **extra) as eng:  # fmt: skip
            startup = time.perf_counter() - t
            results[name] = {"settings": extra, "startup_s": round(startup, 1)}
            for b in batches:
                r = _run(eng, prompts, b, args.max_new_tokens, args.repeats)
                ids = r.pop("ids")
                if name == "plain":
                    plain_ids[b] = ids
                elif b in plain_ids:
                    r["match"] = sum(x == y for x, y in zip(ids, plain_ids[b])) / len(ids)
                    r["speedup"] = r["tok_s"] / results["plain"][str(b)]["tok_s"]
                    if str(b) in results.get("plain-c8", {}):  # against plain's best: continuous decode
                        r["speedup_vs_plain_c8"] = r["tok_s"] / results["plain-c8"][str(b)]["tok_s"]
                results[name][str(b)] = r
                print(
                    f"{name:>14} b={b:<3} {r['tok_s']:8.0f} tok/s  accept {r['accept_length']:.2f}  "
                    f"speedup {r.get('speedup', 1.0):.2f}  match {r.get('match', 1.0):.2f}",
                    flush=True,
                )
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    record = {"command": "python3 benchmarks/gpu/spec_engine.py " + " ".join(sys.argv[1:]),
              "git_commit": commit or os.environ.get("GIT_COMMIT", ""), "date": time.strftime("%Y-%m-%d"),
              "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "quantization": args.quantization,
              "results": results}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
