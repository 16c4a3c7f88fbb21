"""Constrained vs unconstrained decode speed per grammar backend, jump-forward on and off, and compile cost.

    python -m phloem.bench.grammar_decode [--backends xgrammar,llguidance,outlines]
        [--batch-sizes 1,32,128] [--output-len 32] [--kinds none,json_schema,regex,mixed]
        [--no-jump-forward] [--output-file benchmarks/results/cpu/grammar_decode.json] [engine flags]

Engine flags are ``phloem serve``'s, so the same command runs a GPU with random weights of a real
shape: ``--device cuda --load-format dummy --dummy-shape llama3-8b --tokenizer-path DIR``.

For each backend one Engine runs, for each batch size, the same static batch as each kind: ``none``
(no grammar), ``json_schema`` (a list of records), ``regex`` (a list of dates), ``mixed`` (every
other row under the JSON schema, the rest free; batches of 2 or more) and ``long_keys`` (records
whose keys are long fixed strings: most of the text is forced). Every grammar needs more tokens
than ``--output-len`` to complete (sized with the model's tokenizer, as the serving benchmark's
``json-schema`` and ``regex`` datasets are), and every row is sent with ``ignore_eos``, so each
request decodes exactly ``--output-len`` tokens and the rows compare like with like. A second Engine
with ``--enable-jump-forward`` runs ``long_keys`` again (skip with ``--no-jump-forward``).

Decode tokens/s is ``batch * (output_len - 1)`` over the time from the batch's last first token to
its last token (as ``phloem bench one-batch``); ``ratio`` is over the same backend's ``none`` row at
that batch size (the unconstrained rate is the ceiling a grammar can reach); ``jump_forward_speedup``
is a jump-forward row over the same row without it. ``invalid`` counts constrained outputs that
break their grammar (``phloem.bench.validity``: a reply cut at its length must be a valid start);
the command exits 1 when any is. Compile cost is seen end to end: the latency of a one-token request
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

from phloem.bench.datasets import (
    SHORTEST_DATE,
    SHORTEST_RECORD,
    TokenizerLike,
    dates_regex,
    records_schema,
    units_needed,
)
from phloem.bench.validity import output_ok

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "cpu" / "grammar_decode.json"
BACKENDS = ("xgrammar", "llguidance", "outlines")
KINDS = ("none", "json_schema", "regex", "mixed")
PROMPT = "List some records as JSON, then some dates, one after another:"

# Keys far longer than the values: with jump-forward on, most of each record is appended without
# a forward pass per token.
LONG_KEYS_RECORD: dict[str, Any] = {
    "type": "object",
    "properties": {
        "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 999},
        "preferred_delivery_window_description": {"type": "string", "maxLength": 8},
        "requires_signature_on_delivery": {"type": "boolean"},
    },
    "required": [
        "customer_account_identifier",
        "preferred_delivery_window_description",
        "requires_signature_on_delivery",
    ],
    "additionalProperties": False,
}
SHORTEST_LONG_KEYS_RECORD = (
    '{"customer_account_identifier":0,"preferred_delivery_window_description":"",'
    '"requires_signature_on_delivery":true}'
)


def grammars(tokenizer: TokenizerLike, output_len: int) -> dict[str, dict[str, str]]:
    """Grammar name -> its sampling-param keys; none can complete within ``output_len`` tokens."""

    def records(item: dict[str, Any], shortest: str) -> str:
        count = units_needed(tokenizer, shortest, output_len)
        return json.dumps({"type": "array", "items": item, "minItems": count})

    return {
        "json_schema": {
            "json_schema": json.dumps(records_schema(units_needed(tokenizer, SHORTEST_RECORD, output_len)))
        },
        "regex": {"regex": dates_regex(units_needed(tokenizer, SHORTEST_DATE, output_len))},
        "long_keys": {"json_schema": records(LONG_KEYS_RECORD, SHORTEST_LONG_KEYS_RECORD)},
    }


def row_grammars(kind: str, table: dict[str, dict[str, str]], batch: int) -> list[dict[str, str]]:
    """The grammar keys of each of the batch's rows: ``mixed`` constrains every other row."""
    if kind == "none":
        return [{} for _ in range(batch)]
    if kind == "mixed":
        return [table["json_schema"] if i % 2 == 0 else {} for i in range(batch)]
    return [table[kind] for _ in range(batch)]


def check_args(grammar: dict[str, str]) -> dict[str, Any]:
    """``validity.output_ok``'s keyword arguments for a row's grammar keys."""
    if "json_schema" in grammar:
        return {"json_schema": json.loads(grammar["json_schema"])}
    return {"regex": grammar["regex"]} if "regex" in grammar else {}


def decode_point(engine: Any, rows: list[dict[str, str]], output_len: int) -> dict[str, Any]:
    """Time one static batch (one request per entry of ``rows``, its grammar keys); fails when a
    request stops before ``output_len`` tokens. Outputs are checked after the clock stops."""
    base = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    batch = len(rows)
    engine.flush_cache()
    prompts = [f"{PROMPT} (batch row {i})" for i in range(batch)]
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    tokens: dict[int, int] = {}
    first_tokens: dict[int, int] = {}  # more than 1 when jump-forward appended text at once
    texts: dict[int, str] = {}
    start = time.perf_counter()
    stream = engine.generate(prompts, sampling_params=[base | g for g in rows], stream=True)
    for chunk in stream:
        now = time.perf_counter()
        i = chunk["index"]
        first.setdefault(i, now)
        last[i] = now
        tokens[i] = chunk["meta_info"]["completion_tokens"]
        first_tokens.setdefault(i, tokens[i])
        texts[i] = chunk["text"]
        reason = chunk["meta_info"]["finish_reason"]
        if reason is not None and reason["type"] != "length":
            raise RuntimeError(f"row {i} ended early ({reason}): {chunk['text'][:200]!r}")
    if sorted(tokens.values()) != [output_len] * batch:
        raise RuntimeError(f"expected {output_len} tokens per row, got {sorted(tokens.values())}")
    prefill = max(first.values()) - start
    decode = max(last.values()) - max(first.values())
    steps = sum(output_len - n for n in first_tokens.values())  # tokens after each row's first chunk
    total = max(last.values()) - start
    constrained = [i for i, g in enumerate(rows) if g]
    invalid = sum(not output_ok(texts[i], finished=False, **check_args(rows[i])) for i in constrained)
    return {
        "prefill_s": prefill,
        "decode_s": decode,
        "decode_tok_s": steps / decode if decode > 0 and steps else None,
        "total_tok_s": batch * output_len / total,
        "constrained_rows": len(constrained),
        "invalid": invalid,
    }


def one_token_latency(engine: Any, grammar: dict[str, Any]) -> float:
    start = time.perf_counter()
    out = engine.generate("Answer:", sampling_params={"max_new_tokens": 1, "temperature": 0, **grammar})
    reason = out["meta_info"]["finish_reason"]
    if reason["type"] == "abort":
        raise RuntimeError(f"grammar failed: {reason}")
    return time.perf_counter() - start


def compile_point(engine: Any, grammar: dict[str, str], repeat: int) -> dict[str, Any]:
    """One-token latency (ms): the first compile of this kind in the engine (cold), then medians with
    a new grammar, the same grammar cached, and none."""

    def fresh(k: int) -> dict[str, str]:
        if "json_schema" in grammar:
            schema = {**json.loads(grammar["json_schema"]), "title": f"fresh {time.time_ns()} {k}"}
            return {"json_schema": json.dumps(schema)}
        return {"regex": grammar["regex"] + f"( x{time.time_ns()}{k})?"}  # same language, new text

    firsts, cached, none = [], [], []
    for k in range(repeat):
        new = fresh(k)
        firsts.append(one_token_latency(engine, new))
        cached.append(one_token_latency(engine, new))
        none.append(one_token_latency(engine, {}))

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2] * 1e3

    return {
        "cold_ms": firsts[0] * 1e3,
        "first_ms": med(firsts),
        "cached_ms": med(cached),
        "no_grammar_ms": med(none),
    }


def start_engine(engine_args: dict[str, Any], backend: str, jump_forward: bool) -> Any:
    from phloem import Engine

    return Engine(**{**engine_args, "grammar_backend": backend, "enable_jump_forward": jump_forward})


def run_engine(
    engine: Any,
    backend: str,
    kinds: list[str],
    jump_forward: bool,
    ns: argparse.Namespace,
    rows: list[dict[str, Any]],
) -> None:
    """Append to ``rows`` one row per (kind, batch size) on ``engine``; compile timings where asked."""
    table = grammars(engine.tm.tokenizer, ns.output_len)
    one_token_latency(engine, {})  # warm-up
    compiles: dict[str, dict[str, Any]] = {}
    if not jump_forward and ns.compile_repeat > 0:
        compiles = {
            k: compile_point(engine, table[k], ns.compile_repeat)
            for k in ("json_schema", "regex")
            if k in kinds
        }
    for kind in kinds:
        grammar = table["json_schema"] if kind == "mixed" else table.get(kind)
        if grammar is not None:
            one_token_latency(engine, grammar)  # compiled and cached before timing
        for batch in ns.batch_sizes:
            if kind == "mixed" and batch < 2:
                continue
            point = decode_point(engine, row_grammars(kind, table, batch), ns.output_len)
            row = {"backend": backend, "grammar": kind, "jump_forward": jump_forward, "batch_size": batch}
            rows.append(row | {"output_len": ns.output_len} | point | compiles.get(kind, {}))
            print(format_row(rows[-1], rows), flush=True)


def bench_backend(backend: str, ns: argparse.Namespace, engine_args: dict[str, Any]) -> list[dict[str, Any]]:
    """Every kind and ``long_keys`` on an Engine without jump-forward, then ``long_keys`` with it."""
    rows: list[dict[str, Any]] = []
    plans = [(False, [*ns.kinds, "long_keys"] if ns.jump_forward else ns.kinds)]
    if ns.jump_forward:
        plans.append((True, ["long_keys"]))
    for jump_forward, kinds in plans:
        engine = start_engine(engine_args, backend, jump_forward)
        try:
            run_engine(engine, backend, kinds, jump_forward, ns, rows)
        finally:
            engine.shutdown()
    return rows


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with ``ratio``: its decode tokens/s over the same backend's unconstrained row at that
    batch size; jump-forward rows also with ``jump_forward_speedup``: the whole batch's tokens/s
    (``total_tok_s``, from sending to the last token) over the same row without jump-forward. The
    whole batch, because jump-forward also appends forced text to the first chunk, which the decode
    window (from the last first chunk) leaves out."""
    floor = {(r["backend"], r["batch_size"]): r["decode_tok_s"] for r in rows if r["grammar"] == "none"}
    plain = {
        (r["backend"], r["grammar"], r["batch_size"]): r["total_tok_s"] for r in rows if not r["jump_forward"]
    }
    out = []
    for r in rows:
        base = floor.get((r["backend"], r["batch_size"]))
        extra: dict[str, Any] = {"ratio": _over(r["decode_tok_s"], base)}
        if r["jump_forward"]:
            extra["jump_forward_speedup"] = _over(
                r["total_tok_s"], plain.get((r["backend"], r["grammar"], r["batch_size"]))
            )
        out.append(r | extra)
    return out


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


HEADER = (
    f"{'backend':<11}{'grammar':<12}{'jf':>4}{'batch':>6}{'decode tok/s':>14}{'ratio':>7}{'total tok/s':>13}"
    f"{'invalid':>9}"
    f"{'cold ms':>9}{'first ms':>10}{'cached ms':>11}{'no grammar ms':>15}"
)


def format_row(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    ratio = with_ratios([r for r in rows if r["grammar"] == "none"] + [row])[-1]["ratio"]
    decode = "-" if row["decode_tok_s"] is None else f"{row['decode_tok_s']:.1f}"
    compile_cols = (
        f"{row['cold_ms']:>9.1f}{row['first_ms']:>10.1f}{row['cached_ms']:>11.1f}{row['no_grammar_ms']:>15.1f}"
        if "first_ms" in row
        else f"{'-':>9}{'-':>10}{'-':>11}{'-':>15}"
    )
    invalid = f"{row['invalid']}/{row['constrained_rows']}"
    shown = "-" if ratio is None else f"{ratio:.2f}"
    return (
        f"{row['backend']:<11}{row['grammar']:<12}{'on' if row['jump_forward'] else 'off':>4}{row['batch_size']:>6}"
        f"{decode:>14}{shown:>7}{row['total_tok_s']:>13.1f}{invalid:>9}"
        f"{compile_cols}"
    )


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0],
    }
    if device != "cpu" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def name_list(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def int_list(value: str) -> list[int]:
    return [int(x) for x in name_list(value)]


def kind_list(value: str) -> list[str]:
    kinds = name_list(value)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown kind(s) {', '.join(unknown)}; known: {', '.join(KINDS)}")
    return kinds


def build_parser() -> argparse.ArgumentParser:
    from phloem.runtime.config import EngineArgs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--backends", type=name_list, default=list(BACKENDS), help="comma-separated grammar backends"
    )
    p.add_argument("--batch-sizes", type=int_list, default=[1, 32, 128], help="comma-separated batch sizes")
    p.add_argument("--output-len", type=int, default=32, help="decode tokens per request")
    p.add_argument("--kinds", type=kind_list, default=list(KINDS), help="comma-separated: " + ",".join(KINDS))
    p.add_argument(
        "--no-jump-forward", dest="jump_forward", action="store_false", help="skip the long_keys rows"
    )
    p.add_argument(
        "--compile-repeat", type=int, default=3, help="fresh grammars per compile timing (0: skip)"
    )
    p.add_argument("--output-file", default=str(DEFAULT_OUTPUT), help="JSON results ('' to skip)")
    # --grammar-backend and --enable-jump-forward are set per Engine from --backends and the plan.
    group = p.add_argument_group("engine flags (as phloem serve's)")
    EngineArgs.add_cli_args(group)  # type: ignore[arg-type]
    p.set_defaults(log_level="warning")
    return p


def engine_args(ns: argparse.Namespace) -> dict[str, Any]:
    from phloem.runtime.config import EngineArgs

    return EngineArgs.from_cli(ns).to_dict()


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.output_len < 2:
        raise SystemExit("--output-len must be at least 2 (decode speed needs a second token)")
    args = engine_args(ns)
    print(HEADER, flush=True)
    rows: list[dict[str, Any]] = []
    for backend in ns.backends:
        rows += bench_backend(backend, ns, args)
    rows = with_ratios(rows)
    invalid = sum(r["invalid"] for r in rows)
    if ns.output_file:
        shown = {
            k: args[k]
            for k in ("device", "dtype", "load_format", "dummy_shape", "model_path", "tokenizer_path")
        }
        record = {
            "command": "python -m phloem.bench.grammar_decode "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(args["device"]),
            "engine": shown,
            "invalid_outputs": invalid,
            "rows": rows,
        }
        Path(ns.output_file).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.output_file).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {ns.output_file}")
    if invalid:
        print(f"{invalid} constrained outputs break their grammar", file=sys.stderr)
    return 1 if invalid else 0


if __name__ == "__main__":
    raise SystemExit(main())
