"""Grammars on the device through the Engine on the default model (``grammar_on_device="on"`` on
the CPU, which runs the same tensor code as CUDA): JSON-schema and regex rows mixed with free
rows decode in continuous batches with the overlap loop, every constrained output is valid, and
the tokens are those of the host path over the same DFA (outlines backend, one step per launch).
A schema the conversion would weaken takes the host path of the server's backend, in the same
engine, and is still valid."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from phloem import Engine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}( ext \d{1,4})?"
# a document whose shortest output is long (40 tokens), so its end is a region of its own: a
# continuous batch of it alone is read at once near the end (``Scheduler._may_all_end``)
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "email", "role", "address"],
}
RECORD_PARAMS = {"temperature": 0, "max_new_tokens": 120, "json_schema": json.dumps(RECORD)}
# every way through it is bounded (a short string, an enum, a boolean): the scheduler knows the
# most tokens left at each point and launches no step past them (``Scheduler._output_cap``)
SHORT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "role", "ok"],
}
BOUNDED = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 99}}, "required": ["n"]}
PROMPTS = [
    "Describe a person as JSON:",
    "A user record in JSON:",
    "Call me at",
    "Tell me a story about a cat.",
    "JSON for a new employee:",
    "What is 2 + 2?",
]
GREEDY = {"temperature": 0, "max_new_tokens": 48}
PARAMS = [
    {**GREEDY, "json_schema": json.dumps(PERSON)},
    {**GREEDY, "json_schema": json.dumps(PERSON)},
    {**GREEDY, "regex": PHONE},
    {**GREEDY, "max_new_tokens": 24},
    {"temperature": 0.9, "max_new_tokens": 48, "json_schema": json.dumps(PERSON)},  # sampled: valid only
    {**GREEDY, "max_new_tokens": 16},
]
CONTINUOUS = {"num_continuous_decode_steps": 4, "continuous_decode_budget_ms": 60_000.0}


@pytest.fixture(scope="module")
def runs():
    with Engine(log_level="warning", grammar_on_device="on", enable_cpu_overlap_schedule=True, **CONTINUOUS) as eng:
        device = eng.generate(PROMPTS, sampling_params=PARAMS)
        steps = eng.get_server_info()["live"]["continuous_decode_steps_total"]
        bounded = eng.generate("A number as JSON:", sampling_params={**GREEDY, "json_schema": json.dumps(BOUNDED)})
        record = eng.generate("A user record as JSON:", sampling_params=RECORD_PARAMS)
        syncs = eng.get_server_info()["live"]["near_end_syncs_total"]
        before = eng.get_server_info()["live"]["continuous_decode_steps_total"]
        short = eng.generate("A user as JSON:", sampling_params={**GREEDY, "json_schema": json.dumps(SHORT)})
        short_steps = eng.get_server_info()["live"]["continuous_decode_steps_total"] - before
    with Engine(log_level="warning", grammar_backend="outlines", grammar_on_device="off") as eng:
        host = eng.generate(PROMPTS, sampling_params=PARAMS)
        host_record = eng.generate("A user record as JSON:", sampling_params=RECORD_PARAMS)
    return device, steps, bounded, host, (record, syncs, host_record), (short, short_steps)


def _check_valid(out: dict, params: dict) -> None:
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    if "json_schema" in params:
        jsonschema.validate(json.loads(out["text"]), json.loads(params["json_schema"]))
    if "regex" in params:
        assert re.fullmatch(params["regex"], out["text"]), out["text"]


def test_constrained_rows_are_valid(runs):
    device, _, bounded, host, _, _ = runs
    for outs in (device, host):
        for out, params in zip(outs, PARAMS):
            if "json_schema" in params or "regex" in params:
                _check_valid(out, params)
    _check_valid(bounded, {"json_schema": json.dumps(BOUNDED)})


def test_greedy_tokens_equal_the_host_path_over_the_same_dfa(runs):
    device, _, _, host, _, _ = runs
    for i, params in enumerate(PARAMS):
        if params["temperature"] == 0:
            assert device[i]["output_ids"] == host[i]["output_ids"], PROMPTS[i]


def test_constrained_batches_ran_continuous_steps(runs):
    device, steps, _, _, _, _ = runs
    longest = max(o["meta_info"]["completion_tokens"] for o in device)
    # every row may decode ahead, so most steps run four to a launch
    assert steps >= 0.5 * (longest - 1)


def test_a_record_alone_is_read_at_once_near_its_end_and_keeps_its_tokens(runs):
    """The overlap loop processes the record's batch at once when it may have ended, instead of
    queueing a launch behind it; the output is the host path's, token for token, and valid."""
    record, syncs, host_record = runs[4]
    _check_valid(record, RECORD_PARAMS)
    assert record["output_ids"] == host_record["output_ids"]
    assert 1 <= syncs <= 3


def test_no_launch_runs_past_the_most_tokens_a_bounded_grammar_allows(runs):
    """A document bounded everywhere: once the host has seen where the row is, no step is launched
    past the most tokens the grammar still allows, so less than one launch of 4 steps runs after
    the stop (the overlap loop alone queues a whole launch behind it)."""
    short, steps = runs[5]
    _check_valid(short, {"json_schema": json.dumps(SHORT)})
    decoded = short["meta_info"]["completion_tokens"] - 1  # the first token comes from the prefill
    assert decoded <= steps < decoded + 4
