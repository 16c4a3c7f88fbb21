"""Validity of constrained outputs, finished or cut at their length, and how the report counts them."""

from __future__ import annotations

import json

import pytest
from phloem.bench.client import Result
from phloem.bench.datasets import RECORD, dates_regex, records_schema
from phloem.bench.report import format_report, summarize
from phloem.bench.validity import json_prefix_ok, last_record_end, output_ok, regex_prefix_ok

SCHEMA = records_schema(3)
REC = {"name": "Ann", "city": "Oslo", "year": 1999}
THREE = json.dumps([REC, REC, REC], separators=(",", ":"))


def test_last_record_end_skips_strings():
    body = '[{"name":"} ]","city":"x","year":1900},{"name":"'
    assert body[last_record_end(body)] == "}" and body[: last_record_end(body) + 1].endswith("1900}")
    assert last_record_end("[") == 0 and last_record_end('[{"a":') == 0


@pytest.mark.parametrize("cut", range(0, len(THREE)))
def test_every_cut_of_a_valid_document_is_a_valid_start(cut):
    text = THREE[:cut]
    assert json_prefix_ok(SCHEMA, text, finished=False) is text.startswith("[")


def test_finished_documents_must_validate():
    assert json_prefix_ok(SCHEMA, THREE, finished=True)
    assert not json_prefix_ok(SCHEMA, json.dumps([REC]), finished=True)  # minItems
    assert not json_prefix_ok(SCHEMA, THREE[:-1], finished=True)  # cut short, yet said finished


@pytest.mark.parametrize(
    "text",
    [
        '[{"name":"ann","city":"Oslo","year":1800},',  # a name outside its pattern
        '[{"name":"a","city":"b"},{"name":',  # a required key missing
        '[{"name":"a","city":"b","year":1900,"x":1},',  # an extra key
        '{"name":"a"',  # not an array
        "Sure! Here are the records",  # not JSON at all
        '[{"name":"a",,"city":"b","year":1900},{',  # broken syntax before the cut
    ],
)
def test_broken_starts_are_invalid(text):
    assert not json_prefix_ok(SCHEMA, text, finished=False)


def test_the_record_cut_short_is_not_checked():
    """Only completed records are validated: a cut record holding an error still passes (the
    server's grammar is what the check audits, and it rejects such text token by token)."""
    assert json_prefix_ok(SCHEMA, '[{"name":"a",,', finished=False)


def test_record_schema_checks_types():
    bad = {**REC, "year": "1999"}
    assert not json_prefix_ok({"type": "array", "items": RECORD}, json.dumps([bad]) + ",", finished=False)


def test_regex_partial_and_full():
    pattern = dates_regex(2)
    full = "1999-01-31, 2024-12-01, 2001-02-03"
    assert regex_prefix_ok(pattern, full, finished=True)
    assert all(regex_prefix_ok(pattern, full[:k], finished=False) for k in range(len(full)))
    assert not regex_prefix_ok(pattern, full[:20], finished=True)
    assert not regex_prefix_ok(pattern, "1999-01-31, 3", finished=False)
    assert not regex_prefix_ok(pattern, "hello", finished=False)


def test_output_ok_dispatches():
    assert output_ok("anything", finished=True)
    assert output_ok("1999-0", finished=False, regex=dates_regex(1))
    assert not output_ok("x", finished=False, json_schema=SCHEMA)


def result(sid: int, text: str, reason: object) -> Result:
    r = Result(sid, 0, 10, 5, success=True, text=text, server_output_tokens=5, client_output_tokens=5)
    r.finish_reason = reason
    return r


def test_report_counts_invalid_outputs_as_errors():
    grammar = {"json_schema": SCHEMA, "regex": None}
    results = [
        result(0, THREE[:20], {"type": "length"}),  # native finish reason
        result(1, THREE[:30], "length"),  # OpenAI finish reason
        result(2, "not json", "length"),
        result(3, "plain text", {"type": "length"}),  # not constrained
    ]
    report = summarize(results, 1.0, constrained={(0, 0): grammar, (1, 0): grammar, (2, 0): grammar})
    assert report["constrained_invalid"] == 1 and report["constrained_valid_rate"] == pytest.approx(2 / 3)
    assert "1 constrained outputs break their grammar" in report["errors"]
    assert "Constrained valid rate" in format_report(report | {"max_concurrency": 1})
    clean = summarize(results[:2], 1.0, constrained={(0, 0): grammar, (1, 0): grammar})
    assert clean["constrained_invalid"] == 0 and clean["errors"] == []
    none = summarize(results[3:], 1.0)
    assert none["constrained_valid_rate"] is None and "Constrained valid rate" not in format_report(none)


def test_constrained_outputs_are_left_out_of_the_token_count_check():
    """A grammar spells text in tokens the tokenizer would not pick, so their retokenized count is
    lower; only unconstrained requests are compared."""
    grammar = {"json_schema": SCHEMA, "regex": None}
    spelled = [result(i, THREE[:40], "length") for i in range(2)]
    for r in spelled:
        r.server_output_tokens, r.client_output_tokens = 64, 40
    report = summarize(spelled, 1.0, constrained={(0, 0): grammar, (1, 0): grammar})
    assert not report["token_count_mismatch"] and report["errors"] == []
    assert report["token_count_check"] == "not applicable: every output was constrained by a grammar"
    assert report["total_output_tokens_server"] == 128 and report["requests_not_token_checked"] == 2
    assert "Token count check" in format_report(report)
    plain = result(2, "the the", "length")
    plain.server_output_tokens, plain.client_output_tokens = 64, 2
    mixed = summarize([*spelled, plain], 1.0, constrained={(0, 0): grammar, (1, 0): grammar})
    assert mixed["token_count_mismatch"] and mixed["token_count_check"] == "done"
    unconstrained = summarize(spelled, 1.0)
    assert unconstrained["token_count_mismatch"]
