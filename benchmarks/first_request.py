"""The first requests after start-up, with and without the start-up warm-up (``--warmup``).

    python -m phloem.bench.first_request [--warmup off|on|auto] [--device cuda] [engine flags] --out F

Starts an in-process Engine, then sends, one at a time and in this order:

1. ``plain_long``: a greedy request with a long random prompt (``--prompt-tokens``), 8 tokens;
2. ``constrained``: a greedy request under a JSON schema the warm-up does not use;
3. ``plain_long_again``: request 1's shape with another prompt: what a warm engine takes;
4. ``constrained_again``: another new schema.

Each row is the request's latency from send to its last token. Run it once with ``--warmup off``
and once with ``on``: the difference between rows 1-2 and 3-4 is what the first requests pay for
first-use work (kernel builds, allocator growth, the grammar backend's construction). The start-up
time of the Engine is reported too: the warm-up moves cost there.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from phloem.bench.compare import git_state
from phloem.bench.datasets import TextMaker
from phloem.bench.report import emit_json

SCHEMAS = (
    '{"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}',
    '{"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "number"}}, "required": ["ok"]}',
)


def measure(engine_kwargs: dict[str, Any], prompt_tokens: int, seed: int) -> dict[str, Any]:
    from phloem import Engine

    t0 = time.perf_counter()
    eng = Engine(**engine_kwargs)
    startup = time.perf_counter() - t0
    rng = random.Random(seed)
    maker = TextMaker(eng.tm.tokenizer)
    greedy = {"temperature": 0, "max_new_tokens": 8}
    rows: dict[str, float] = {}
    try:
        for name, kw in (
            ("plain_long", {"prompt": maker.make(prompt_tokens, rng), "sampling_params": greedy}),
            ("constrained", {"prompt": "A person as JSON:", "sampling_params": {**greedy, "json_schema": SCHEMAS[0]}}),
            ("plain_long_again", {"prompt": maker.make(prompt_tokens, rng), "sampling_params": greedy}),
            ("constrained_again", {"prompt": "A flag as JSON:", "sampling_params": {**greedy, "json_schema": SCHEMAS[1]}}),
        ):  # fmt: skip
            t = time.perf_counter()
            eng.generate(**kw)
            rows[name] = round((time.perf_counter() - t) * 1000, 1)
        info = eng.get_server_info()
    finally:
        eng.shutdown()
    return {
        "startup_s": round(startup, 2),
        "latency_ms": rows,
        "warmup_s": info.get("warmup_s"),
        "chunked_prefill_size": info.get("chunked_prefill_size"),
        "device": info.get("device"),
    }


def main() -> int:
    from phloem.runtime.config import EngineArgs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(p)
    p.set_defaults(log_level="warning")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    engine_kwargs = EngineArgs.from_cli(ns).to_dict()
    result = {
        "command": " ".join(["python -m phloem.bench.first_request", *sys.argv[1:]]),
        **git_state(),
        "warmup": ns.warmup,
        **measure(engine_kwargs, ns.prompt_tokens, ns.seed),
    }
    emit_json(result, ns.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
