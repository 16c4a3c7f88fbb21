"""Speculative decoding at batch 1 on CPU: accept length and decode speedup (docs/design.md §7, §11).

    python -m phloem.bench.speculative --prompts 4 --max-new-tokens 64

Drives the speculative modules directly on a ``ModelRunner`` (no scheduler). For each prompt
(held-out prompts of the draft head's training file, chat-templated) it runs:

- ``baseline``: the runner's own prefill + one decode step per token (``DirectBatcher``)
- ``eagle-chain``: the shipped EAGLE head drafting a chain (topk 1)
- ``eagle-tree``: the same head drafting a tree (topk > 1, best ``num_draft_tokens`` nodes)
- ``ngram``: longest-suffix-match drafts from the request's own context

all greedy, so every method must reproduce the baseline's tokens (``matches_baseline``). Decode
time excludes the prefill. Prints a table; ``--out F`` also writes the report as JSON.
The floor a CPU decode step cannot beat is reading every weight once (bytes / bandwidth); here
the comparison is against the measured baseline step, which is what speculation amortizes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import torch


def _methods(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    return {
        "eagle-chain": {
            "kind": "eagle",
            "num_steps": args.chain_steps,
            "topk": 1,
            "num_draft_tokens": args.chain_steps + 1,
        },
        "eagle-tree": {
            "kind": "eagle",
            "num_steps": args.tree_steps,
            "topk": args.tree_topk,
            "num_draft_tokens": args.tree_tokens,
        },  # fmt: skip
        "ngram": {"kind": "ngram", "num_draft": args.ngram_draft, "max_ngram": 4},
    }


def _baseline(runner: Any, prompt: list[int], n: int, stop: set[int]) -> tuple[list[int], float]:
    from phloem.runtime.executor.model_runner import DirectBatcher

    b = DirectBatcher(runner)
    seq = b.new_sequence()
    try:
        out = [b.step({seq: prompt}).synchronize()[0]]
        t0 = time.perf_counter()
        while len(out) < n and out[-1] not in stop:
            out.append(b.step({seq: [out[-1]]}, decode=True).synchronize()[0])
        return out, time.perf_counter() - t0
    finally:
        b.release(seq)


def _decoder(runner: Any, spec: dict[str, Any], head_path: str) -> Any:
    from phloem.runtime.speculative.decoding import EagleDrafter, NgramDrafter, SpeculativeDecoder
    from phloem.runtime.speculative.eagle import EagleDraftWorker, load_eagle_head
    from phloem.runtime.speculative.ngram import NgramProposer

    if spec["kind"] == "ngram":
        return SpeculativeDecoder(
            runner, NgramDrafter(NgramProposer(spec["num_draft"], max_ngram=spec["max_ngram"]))
        )
    head = load_eagle_head(head_path)
    worker = EagleDraftWorker.for_runner(head, runner, num_steps=spec["num_steps"], topk=spec["topk"],
                                         num_draft_tokens=spec["num_draft_tokens"])  # fmt: skip
    return SpeculativeDecoder(runner, EagleDrafter(worker))


def cpu_target(
    model: str | None, threads: int, num_prompts: int, quantization: str = "auto"
) -> tuple[Any, Any, Any, set[int], list[list[int]]]:
    """The target on the CPU (float32 activations; ``quantization="auto"``: the CPU default, the
    GGUF's own blocks): ``(source, runner, tokenizer, stop ids, prompts)``, the
    prompts being the first ``num_prompts`` of the EAGLE head's held-out ones, chat-templated."""
    from phloem.runtime.executor.model_runner import ModelRunner
    from phloem.runtime.model_files import resolve_model
    from phloem.runtime.tokenizer.tokenizer import load_tokenizer
    from phloem.training.eagle_head import DEFAULT_PROMPTS, encode_prompts, read_prompts

    torch.set_num_threads(threads)
    source = resolve_model(model)
    runner = ModelRunner(
        source, dtype="float32", device="cpu", max_total_tokens=1 << 14, max_running_requests=8,
        quantization=quantization,
    )  # fmt: skip
    tok = load_tokenizer(source)
    prompts = encode_prompts(read_prompts(DEFAULT_PROMPTS)[:num_prompts], tok)  # held out from training
    return source, runner, tok, set(tok.eos_token_ids), prompts


def run(args: argparse.Namespace) -> dict[str, Any]:
    from phloem.training.eagle_head import encode_prompts

    source, runner, tok, stop, prompts = cpu_target(args.model, args.threads, args.prompts, args.quantization)
    if args.ngram_prompt:  # a prompt that invites copying, where n-gram drafting shines
        prompts.append(
            encode_prompts(
                ["Repeat this list exactly three times: apple, banana, cherry, date, elderberry."], tok
            )[0]
        )
    # Methods run interleaved prompt by prompt, so a shared machine's load shifts hit all alike.
    decoders = {name: _decoder(runner, spec, args.head) for name, spec in _methods(args).items()}
    acc: dict[str, dict[str, Any]] = {
        n: {"lens": [], "secs": 0.0, "toks": 0, "same": True, "draft": 0.0, "verify": 0.0}
        for n in ["baseline", *decoders]
    }
    for n, p in enumerate(prompts, start=1):
        ref, dt = _baseline(runner, p, args.max_new_tokens, stop)
        acc["baseline"]["secs"] += dt
        acc["baseline"]["toks"] += len(ref) - 1
        for name, dec in decoders.items():
            o = dec.generate([p], args.max_new_tokens, stop_ids=stop)[0]
            a = acc[name]
            a["lens"] += o.accept_lengths
            a["secs"] += o.decode_seconds
            a["draft"] += o.draft_seconds
            a["verify"] += o.verify_seconds
            a["toks"] += len(o.tokens) - 1
            a["same"] &= o.tokens == ref
        print(f"prompt {n}/{len(prompts)} done", flush=True)
    base_tps = acc["baseline"]["toks"] / acc["baseline"]["secs"]
    rows: dict[str, dict[str, Any]] = {}
    for name, a in acc.items():
        tps = a["toks"] / a["secs"] if a["secs"] else 0.0
        rows[name] = {
            "accept_length": sum(a["lens"]) / len(a["lens"]) if a["lens"] else 1.0,
            "decode_tok_s": tps,
            "speedup": tps / base_tps,
            "matches_baseline": a["same"],
            "decoded_tokens": a["toks"],
        }
        if name == "baseline":
            rows[name]["ms_per_decode_step"] = 1e3 / tps if tps else 0.0
        if name != "baseline":
            steps = max(len(a["lens"]), 1)
            per_step = (a["draft"] + a["verify"]) / steps
            rows[name]["ms_draft_per_step"] = 1e3 * a["draft"] / steps  # proposing + catch-up
            rows[name]["ms_verify_per_step"] = 1e3 * a["verify"] / steps
            # accept length at which this method would match plain decoding's speed
            rows[name]["break_even_accept_length"] = per_step * base_tps
            rows[name]["settings"] = {k: v for k, v in _methods(args)[name].items() if k != "kind"}
    return {
        "model": source.name,
        "device": "cpu",
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "machine": platform.machine(),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "head": os.path.relpath(args.head, os.getcwd()) if args.head else None,
        "results": rows,
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"{'method':<12} {'accept len':>10} {'decode tok/s':>13} {'speedup':>8} {'same tokens':>12} "
          f"{'draft ms':>9} {'verify ms':>10} {'break-even len':>15}")  # fmt: skip
    for name, r in report["results"].items():
        extra = (
            f" {r['ms_draft_per_step']:>9.1f} {r['ms_verify_per_step']:>10.1f} {r['break_even_accept_length']:>15.2f}"
            if "ms_draft_per_step" in r
            else f" {'':>9} {r['ms_per_decode_step']:>10.1f}"
        )
        print(f"{name:<12} {r['accept_length']:>10.2f} {r['decode_tok_s']:>13.2f} {r['speedup']:>7.2f}x "
              f"{str(r['matches_baseline']):>12}{extra}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from phloem.runtime.speculative import DEFAULT_EAGLE_HEAD

    p = argparse.ArgumentParser(prog="phloem bench speculative", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="target (default: the default model)")
    p.add_argument("--head", default=DEFAULT_EAGLE_HEAD, help="EAGLE head .safetensors")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    p.add_argument("--quantization", default="auto", help="auto (the CPU default: the GGUF's blocks) or none")
    p.add_argument("--chain-steps", type=int, default=3)
    p.add_argument("--tree-steps", type=int, default=4)
    p.add_argument("--tree-topk", type=int, default=4)
    p.add_argument("--tree-tokens", type=int, default=8)
    p.add_argument("--ngram-draft", type=int, default=4)
    p.add_argument("--no-ngram-prompt", dest="ngram_prompt", action="store_false")
    p.add_argument("--out", default=None, help="also write the report as JSON here")
    args = p.parse_args(argv)
    report = run(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    print_table(report)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
