"""SamplingParams: wire validation (one table of bad inputs), round trips, normalized views."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.sampling.params import SamplingParams, validate_token_ids

# (wire dict, field the error must name)
BAD = [
    ({"temperature": -1}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.01}, "min_p"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 2.1}, "repetition_penalty"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 10.0}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"min_new_tokens": 20, "max_new_tokens": 10}, "min_new_tokens"),
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),
    ({"json_schema": "{}", "regex": "a+"}, "regex"),
    ({"regex": "a", "ebnf": "root ::= 'a'"}, "ebnf"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": "[1, 2]"}, "json_schema"),
    ({"json_schema": 3}, "json_schema"),
    ({"structural_tag": "[]"}, "structural_tag"),
    ({"regex": ""}, "regex"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop[1]"),
    ({"stop": ["x"] * 33}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", 1]}, "stop[1]"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids[1]"),
    ({"stop_token_ids": 7}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids[0]"),
    ({"stop_regex": "(unclosed"}, "stop_regex"),
    ({"stop_regex": ["ok", "a*"]}, "stop_regex[1]"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": float("inf")}}, "logit_bias"),
    ({"logit_bias": {"-5": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": "high"}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
    ({"no_stop_trim": 0}, "no_stop_trim"),
    ({"sampling_seed": 1.5}, "sampling_seed"),
    ({"sampling_seed": 1 << 64}, "sampling_seed"),
    ({"custom_params": [1]}, "custom_params"),
    ({"stream_interval": 0}, "stream_interval"),
    ({"temprature": 0.5}, "temprature"),
    ({"max_tokens": 5}, "max_tokens"),
]


@pytest.mark.parametrize("wire, field", BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_bad_input_names_the_field(wire, field):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams.from_wire(wire)
    assert err.value.field == f"sampling_params.{field}"
    assert str(err.value).startswith(f"sampling_params.{field}: ")


def test_message_shape():
    with pytest.raises(InvalidRequest) as err:
        SamplingParams.from_wire({"temperature": -1})
    assert str(err.value) == "sampling_params.temperature: must be >= 0, got -1"
    assert err.value.message == "must be >= 0, got -1"


def test_unknown_keys_are_all_listed():
    with pytest.raises(InvalidRequest) as err:
        SamplingParams.from_wire({"foo": 1, "bar": 2, "temperature": 0.1})
    assert "bar" in err.value.message and "foo" in err.value.message


def test_not_an_object():
    with pytest.raises(InvalidRequest) as err:
        SamplingParams.from_wire([1, 2])  # type: ignore[arg-type]
    assert err.value.field == "sampling_params"


def test_direct_construction_validates_too():
    with pytest.raises(InvalidRequest):
        SamplingParams(top_p=0.0)


GOOD = [
    {},
    {"max_new_tokens": 0},
    {"temperature": 0, "top_k": 1},
    {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05},
    {"frequency_penalty": -2, "presence_penalty": 2, "repetition_penalty": 1.3},
    {"stop": "\n\n", "stop_token_ids": [2, 7], "stop_regex": ["[0-9]{3}", "END"]},
    {"stop": ["a", "b"], "no_stop_trim": True, "ignore_eos": True},
    {"json_schema": json.dumps({"type": "object"}), "n": 4},
    {"regex": "[a-z]+", "sampling_seed": -5},
    {"ebnf": 'root ::= "yes" | "no"', "skip_special_tokens": False, "spaces_between_special_tokens": False},
    {"structural_tag": json.dumps({"structures": [], "triggers": []})},
    {"logit_bias": {"5": 1.5, "7": -100}, "stream_interval": 4, "min_new_tokens": 3},
    {"custom_params": {"anything": [1, 2]}},
]


@pytest.mark.parametrize("wire", GOOD)
def test_good_inputs_round_trip(wire):
    p = SamplingParams.from_wire(wire)
    again = SamplingParams.from_wire(json.loads(json.dumps(p.to_wire())))
    assert again == p


def test_defaults_match_the_wire_contract():
    p = SamplingParams.from_wire(None)
    assert (p.max_new_tokens, p.min_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (
        128,
        0,
        1.0,
        1.0,
        -1,
        0.0,
    )
    assert (p.repetition_penalty, p.n, p.skip_special_tokens, p.spaces_between_special_tokens) == (
        1.0,
        1,
        True,
        True,
    )
    assert p.to_wire() == {}


def test_normalizations():
    p = SamplingParams.from_wire(
        {"temperature": 1, "top_k": 0, "json_schema": {"type": "string"}, "logit_bias": {"12": 2, 3: -1}}
    )
    assert p.temperature == 1.0 and isinstance(p.temperature, float)
    assert p.top_k == -1
    assert p.json_schema == '{"type": "string"}'
    assert p.logit_bias == {12: 2.0, 3: -1.0}
    assert p.to_wire()["logit_bias"] == {"12": 2.0, "3": -1.0}
    assert p.grammar == ("json_schema", '{"type": "string"}')


def test_null_means_default():
    p = SamplingParams.from_wire({"temperature": None, "max_new_tokens": None, "stop": None})
    assert p == SamplingParams()


def test_views():
    assert SamplingParams(stop="x").stop_strs == ("x",)
    assert SamplingParams(stop=["x", "y"]).stop_strs == ("x", "y")
    assert SamplingParams().stop_strs == ()
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy
    assert SamplingParams(regex="a+").grammar == ("regex", "a+")
    assert SamplingParams().grammar is None
    assert SamplingParams(presence_penalty=0.5).has_penalties and not SamplingParams().has_penalties


def test_validate_vocab():
    SamplingParams(stop_token_ids=[0, 99], logit_bias={5: 1.0}).validate_vocab(100)
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(stop_token_ids=[100]).validate_vocab(100)
    assert err.value.field == "sampling_params.stop_token_ids[0]"
    with pytest.raises(InvalidRequest) as err:
        SamplingParams.from_wire({"logit_bias": {"1000": 1}}).validate_vocab(100)
    assert err.value.field.startswith("sampling_params.logit_bias")


def test_validate_token_ids():
    validate_token_ids([0, 1, 9], 10, "input_ids")
    for bad, where in (
        ([0, 10], "input_ids[1]"),
        ([-1], "input_ids[0]"),
        (["3"], "input_ids[0]"),
        ([True], "input_ids[0]"),
    ):
        with pytest.raises(InvalidRequest) as err:
            validate_token_ids(bad, 10, "input_ids")
        assert err.value.field == where


def test_error_survives_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(InvalidRequest("sampling_params.n", "must be >= 1, got 0")))
    assert err.field == "sampling_params.n" and str(err) == "sampling_params.n: must be >= 1, got 0"


_valid = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(0, 5),
        "top_p": st.floats(0.01, 1),
        "top_k": st.one_of(st.just(-1), st.integers(1, 1000)),
        "min_p": st.floats(0, 1),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.01, 2),
        "max_new_tokens": st.integers(0, 4096),
        "stop": st.lists(st.text(min_size=1, max_size=8), max_size=4),
        "stop_token_ids": st.lists(st.integers(0, 50000), max_size=4),
        "logit_bias": st.dictionaries(st.integers(0, 50000).map(str), st.floats(-100, 100), max_size=4),
        "sampling_seed": st.integers(-(1 << 63), (1 << 63) - 1),
        "ignore_eos": st.booleans(),
    },
)


@settings(max_examples=60, deadline=None)
@given(_valid)
def test_round_trip_property(wire):
    p = SamplingParams.from_wire(wire)
    assert SamplingParams.from_wire(json.loads(json.dumps(p.to_wire()))) == p


def test_crosses_to_the_scheduler_as_itself_without_a_second_check(monkeypatch):
    """The tokenized request carries the SamplingParams built where the request entered; the
    scheduler's decode restores it as is, and does not run the checks again."""
    import phloem.runtime.sampling.params as params_module
    from phloem.runtime.messages import Codec, TokenizedGenerateReq, ToScheduler

    p = SamplingParams.from_wire(
        {"max_new_tokens": 7, "stop": ["x"], "logit_bias": {"5": 1}, "json_schema": {"type": "object"}, "top_k": 0}
    )
    codec = Codec(ToScheduler)
    data = codec.encode(TokenizedGenerateReq(rid="r", input_ids=[1], sampling_params=p))

    def checked_again(*args):
        raise AssertionError("validated a second time")

    monkeypatch.setattr(params_module, "_check_relations", checked_again)
    got = codec.decode(data).sampling_params
    assert type(got) is SamplingParams and got == p
    with pytest.raises(AssertionError):  # building one outside a decode still checks it
        SamplingParams(max_new_tokens=1)


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": 10**30}, "top_k"),
        ({"stream_interval": 10**30}, "stream_interval"),
        ({"max_new_tokens": 2**64}, "max_new_tokens"),
        ({"custom_params": {"a": 10**30}}, "custom_params"),
    ],
)
def test_integers_past_int64_are_refused_before_they_reach_the_scheduler(wire, field):
    """They cannot be encoded into the scheduler's message, nor held by an int64 tensor."""
    with pytest.raises(InvalidRequest) as err:
        SamplingParams.from_wire(wire)
    assert err.value.field == f"sampling_params.{field}"
