"""Constrained vs unconstrained decode speed per grammar backend, and first vs cached compile.

    python -m phloem.bench.grammar_decode [--backends xgrammar,llguidance,outlines]
        [--batch-sizes 1,32] [--output-len 32] [--output-file benchmarks/results/cpu/grammar_decode.json]

For each backend one Engine runs, for each batch size, the same static batch three ways: no grammar
(``ignore_eos``), a JSON schema and a regex. Both grammars only accept outputs far longer than
``--output-len`` tokens, so every request decodes exactly that many tokens and the rows compare
like with like. Each grammar is compiled once before it is timed. Decode tokens/s is
``batch * (output_len - 1)`` over the time from the batch's last first token to its last token (as
``phloem bench one-batch``); ``ratio`` is constrained over unconstrained (the unconstrained rate is
the floor a grammar can reach). Compile cost is seen end to end: the latency of a one-token request
whose grammar is new (a fresh ``title`` makes a cache miss) against the same request cached and
against no grammar.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "cpu" / "grammar_decode.json"
BACKENDS = ("xgrammar", "llguidance", "outlines")

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["id", "name", "tags"],
    "additionalProperties": False,
}
# At least 6 items of 14+ tokens each (84+ tokens).
SCHEMA = {"type": "array", "items": ITEM, "minItems": 6}
# At least 16 date groups of 9+ tokens each (digits are single tokens): 144+ tokens.
REGEX = r"(20\d\d-[01]\d-[0-3]\d, ){16}20\d\d-[01]\d-[0-3]\d"
PROMPT = "List some records as JSON, then some dates, one after another:"


def grammars() -> dict[str, dict[str, Any]]:
    """Row name -> the grammar keys of its sampling params."""
    return {"none": {}, "json_schema": {"json_schema": json.dumps(SCHEMA)}, "regex": {"regex": REGEX}}


def decode_point(engine: Any, grammar: dict[str, Any], batch: int, output_len: int) -> dict[str, Any]:
    """Time one static batch; fails when a request stops before ``output_len`` tokens."""
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": not grammar, **grammar}
    engine.flush_cache()
    prompts = [f"{PROMPT} (batch row {i})" for i in range(batch)]
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    tokens: dict[int, int] = {}
    start = time.perf_counter()
    for chunk in engine.generate(prompts, sampling_params=params, stream=True):
        now = time.perf_counter()
        i = chunk["index"]
        first.setdefault(i, now)
        last[i] = now
        tokens[i] = chunk["meta_info"]["completion_tokens"]
        reason = chunk["meta_info"]["finish_reason"]
        if reason is not None and reason["type"] != "length":
            raise RuntimeError(f"row {i} ended early ({reason}): {chunk['text'][:200]!r}")
    if sorted(tokens.values()) != [output_len] * batch:
        raise RuntimeError(f"expected {output_len} tokens per row, got {sorted(tokens.values())}")
    prefill = max(first.values()) - start
    decode = max(last.values()) - max(first.values())
    steps = batch * (output_len - 1)
    return {"prefill_s": prefill, "decode_s": decode, "decode_tok_s": steps / decode if decode else 0.0}


def one_token_latency(engine: Any, grammar: dict[str, Any]) -> float:
    start = time.perf_counter()
    out = engine.generate("Answer:", sampling_params={"max_new_tokens": 1, "temperature": 0, **grammar})
    reason = out["meta_info"]["finish_reason"]
    if reason["type"] == "abort":
        raise RuntimeError(f"grammar failed: {reason}")
    return time.perf_counter() - start


def compile_point(engine: Any, kind: str, repeat: int) -> dict[str, Any]:
    """One-token latency (ms): the first compile of this kind in the engine (cold), then medians with a
    new grammar, the same grammar cached, and none."""

    def fresh(k: int) -> dict[str, str]:
        if kind == "json_schema":
            return {"json_schema": json.dumps({**SCHEMA, "title": f"fresh {time.time_ns()} {k}"})}
        return {"regex": REGEX + f"( x{time.time_ns()}{k})?"}  # same language, new text

    firsts, cached, none = [], [], []
    for k in range(repeat):
        grammar = fresh(k)
        firsts.append(one_token_latency(engine, grammar))
        cached.append(one_token_latency(engine, grammar))
        none.append(one_token_latency(engine, {}))
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    return {"cold_ms": firsts[0] * 1e3, "first_ms": med(firsts), "cached_ms": med(cached), "no_grammar_ms": med(none)}


def bench_backend(backend: str, ns: argparse.Namespace) -> list[dict[str, Any]]:
    from phloem import Engine

    engine = Engine(grammar_backend=backend, log_level="warning")
    rows = []
    try:
        one_token_latency(engine, {})  # warm-up
        compiles = {kind: compile_point(engine, kind, ns.compile_repeat) for kind in ("json_schema", "regex")}
        for kind, grammar in grammars().items():
            if grammar:
                one_token_latency(engine, grammar)  # compiled and cached before timing
            for batch in ns.batch_sizes:
                point = decode_point(engine, grammar, batch, ns.output_len)
                row = {"backend": backend, "grammar": kind, "batch_size": batch, "output_len": ns.output_len}
                rows.append(row | point | compiles.get(kind, {}))
                print(format_row(rows[-1], rows), flush=True)
    finally:
        engine.shutdown()
    return rows


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with ``ratio``: its decode tokens/s over the same backend's unconstrained row."""
    floor = {(r["backend"], r["batch_size"]): r["decode_tok_s"] for r in rows if r["grammar"] == "none"}
    return [r | {"ratio": r["decode_tok_s"] / floor[r["backend"], r["batch_size"]]} for r in rows]


HEADER = (
    f"{'backend':<11}{'grammar':<12}{'batch':>6}{'decode tok/s':>14}{'ratio':>7}"
    f"{'cold ms':>9}{'first ms':>10}{'cached ms':>11}{'no grammar ms':>15}"
)


def format_row(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    floor = next(
        (r["decode_tok_s"] for r in rows if r["grammar"] == "none" and r["batch_size"] == row["batch_size"]),
        None,
    )
    ratio = f"{row['decode_tok_s'] / floor:>7.2f}" if floor else f"{'-':>7}"
    compile_cols = (
        f"{row['cold_ms']:>9.1f}{row['first_ms']:>10.1f}{row['cached_ms']:>11.1f}{row['no_grammar_ms']:>15.1f}"
        if "first_ms" in row
        else f"{'-':>9}{'-':>10}{'-':>11}{'-':>15}"
    )
    return (
        f"{row['backend']:<11}{row['grammar']:<12}{row['batch_size']:>6}{row['decode_tok_s']:>14.1f}"
        f"{ratio}{compile_cols}"
    )


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def int_list(value: str) -> list[int]:
    return [int(x) for x in value.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated grammar backends")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 32], help="comma-separated batch sizes")
    p.add_argument("--output-len", type=int, default=32, help="decode tokens per request (at most 80)")
    p.add_argument("--compile-repeat", type=int, default=3, help="fresh grammars per compile timing")
    p.add_argument("--output-file", default=str(DEFAULT_OUTPUT), help="JSON results ('' to skip)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    print(HEADER, flush=True)
    rows: list[dict[str, Any]] = []
    for backend in ns.backends.split(","):
        rows += bench_backend(backend, ns)
    if ns.output_file:
        import torch

        record = {
            "command": "python -m phloem.bench.grammar_decode " + " ".join(sys.argv[1:] if argv is None else argv),
            "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {
                "platform": platform.platform(),
                "cpu_count": os.cpu_count(),
                "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(),
                "load_avg_1m": os.getloadavg()[0],
            },
            "rows": with_ratios(rows),
        }
        Path(ns.output_file).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.output_file).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {ns.output_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
