"""``python -m phloem.bench.grammar_decode`` end to end on the default model (CPU), tiny sizes."""

from __future__ import annotations

import json

import pytest
from phloem.bench import grammar_decode


@pytest.mark.slow
def test_every_kind_and_jump_forward_on_cpu(tmp_path):
    out = tmp_path / "grammar_decode.json"
    argv = ["--backends", "xgrammar", "--batch-sizes", "2", "--output-len", "6", "--compile-repeat", "1"]
    argv += ["--device", "cpu", "--output-file", str(out)]
    assert grammar_decode.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["invalid_outputs"] == 0 and record["engine"]["device"] == "cpu"
    rows = {(r["grammar"], r["jump_forward"]): r for r in record["rows"]}
    assert set(rows) == {(k, False) for k in grammar_decode.KINDS} | {
        ("long_keys", False),
        ("long_keys", True),
    }
    assert rows["none", False]["ratio"] == 1.0 and rows["none", False]["constrained_rows"] == 0
    assert (
        rows["mixed", False]["constrained_rows"] == 1 and rows["json_schema", False]["constrained_rows"] == 2
    )
    for r in record["rows"]:
        assert r["batch_size"] == 2 and r["output_len"] == 6 and r["invalid"] == 0 and r["total_tok_s"] > 0
        if not r["jump_forward"]:
            assert r["decode_tok_s"] > 0 and r["ratio"] > 0
    assert rows["long_keys", True]["jump_forward_speedup"] > 0
    assert rows["json_schema", False]["cached_ms"] > 0 and "cold_ms" in rows["regex", False]
