"""``phloem.bench.grammar_decode``'s plan and arithmetic: grammars sized past the output length,
mixed batches, ratios, and engine flags as ``phloem serve``'s."""

from __future__ import annotations

import json

import pytest
from phloem.bench import grammar_decode as gd
from phloem.bench.datasets import SHORTEST_DATE, SHORTEST_RECORD


@pytest.fixture(scope="module")
def tok():
    from phloem.runtime.model_files import resolve_model
    from phloem.runtime.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


@pytest.mark.parametrize("output_len", [8, 256])
def test_no_grammar_completes_within_the_output_length(tok, output_len):
    table = gd.grammars(tok, output_len)
    assert set(table) == {"json_schema", "regex", "long_keys"}
    shortest = {
        "json_schema": SHORTEST_RECORD,
        "long_keys": gd.SHORTEST_LONG_KEYS_RECORD,
    }
    for name, unit in shortest.items():
        schema = json.loads(table[name]["json_schema"])
        doc = "[" + ",".join([unit] * schema["minItems"]) + "]"
        assert len(tok.encode(doc)) > output_len
    count = int(table["regex"]["regex"].split("{")[1].split(",")[0])
    assert len(tok.encode(SHORTEST_DATE * count)) > output_len


def test_long_keys_record_is_mostly_forced_text(tok):
    keys = "".join(gd.LONG_KEYS_RECORD["properties"])
    assert len(tok.encode(keys)) > len(tok.encode(gd.SHORTEST_LONG_KEYS_RECORD)) / 2


def test_rows_of_each_kind(tok):
    table = gd.grammars(tok, 16)
    assert gd.row_grammars("none", table, 3) == [{}, {}, {}]
    assert gd.row_grammars("regex", table, 2) == [table["regex"]] * 2
    mixed = gd.row_grammars("mixed", table, 4)
    assert mixed == [table["json_schema"], {}, table["json_schema"], {}]
    assert gd.check_args(table["regex"]) == {"regex": table["regex"]["regex"]}
    assert gd.check_args(table["json_schema"])["json_schema"]["type"] == "array"
    assert gd.check_args({}) == {}


def row(grammar, batch, decode, total, jump_forward=False):
    return {
        "backend": "xgrammar",
        "grammar": grammar,
        "jump_forward": jump_forward,
        "batch_size": batch,
        "decode_tok_s": decode,
        "total_tok_s": total,
        "invalid": 0,
        "constrained_rows": batch,
    }


def test_ratios_and_jump_forward_speedup():
    rows = [
        row("none", 1, 100.0, 80.0),
        row("json_schema", 1, 50.0, 40.0),
        row("long_keys", 1, 40.0, 30.0),
        row("long_keys", 1, None, 90.0, jump_forward=True),  # every token came in one chunk
        row("none", 8, 400.0, 300.0),
        row("mixed", 8, 300.0, 200.0),
    ]
    out = gd.with_ratios(rows)
    assert [r["ratio"] for r in out] == [1.0, 0.5, 0.4, None, 1.0, 0.75]
    assert out[3]["jump_forward_speedup"] == pytest.approx(3.0)
    assert all("jump_forward_speedup" not in r for r in out if not r["jump_forward"])
    assert "-" in gd.format_row(out[3], rows)


def test_engine_flags_are_phloem_serve_flags(tmp_path):
    ns = gd.build_parser().parse_args(
        ["--device", "cuda", "--load-format", "dummy", "--dummy-shape", "llama3-8b"]
        + ["--tokenizer-path", str(tmp_path), "--batch-sizes", "1,32,128", "--kinds", "none,mixed"]
    )
    args = gd.engine_args(ns)
    assert (args["device"], args["load_format"], args["dummy_shape"]) == ("cuda", "dummy", "llama3-8b")
    assert args["tokenizer_path"] == str(tmp_path) and args["log_level"] == "warning"
    assert ns.batch_sizes == [1, 32, 128] and ns.kinds == ["none", "mixed"] and ns.jump_forward
    defaults = gd.build_parser().parse_args([])
    assert defaults.batch_sizes == [1, 32, 128] and defaults.kinds == list(gd.KINDS)


def test_unknown_kind_is_refused(capsys):
    with pytest.raises(SystemExit):
        gd.build_parser().parse_args(["--kinds", "none,yaml"])
    assert "unknown kind(s) yaml" in capsys.readouterr().err
