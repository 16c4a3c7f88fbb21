"""Request expansion (``phloem.runtime.expand``): what one generate call becomes, and what it is
refused for. The ``/generate`` route and ``Engine.generate`` both go through it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.expand import MAX_REQUESTS, GenerateCall, expand, per_sample
from phloem.runtime.sampling.params import SamplingParams

VOCAB = 1000

# (case id, call fields, [(text, input_ids, rid, sampling_seed)] of each request, answer is a list)
GOOD = [
    ("text", {"text": "a"}, [("a", None, None, None)], False),
    ("text-batch", {"text": ["a", "b"]}, [("a", None, None, None), ("b", None, None, None)], True),
    ("text-batch-of-one", {"text": ["a"]}, [("a", None, None, None)], True),
    ("ids", {"input_ids": [5, 6]}, [(None, [5, 6], None, None)], False),
    ("ids-batch", {"input_ids": [[5], [6]]}, [(None, [5], None, None), (None, [6], None, None)], True),
    ("rid", {"text": "a", "rid": "r"}, [("a", None, "r", None)], False),
    ("rid-list", {"text": ["a", "b"], "rid": ["x", "y"]}, [("a", None, "x", None), ("b", None, "y", None)], True),
    (
        "n-with-rid-and-seed",
        {"text": "a", "rid": "r", "sampling_params": {"n": 3, "sampling_seed": 7}},
        [("a", None, "r-0", 7), ("a", None, "r-1", 8), ("a", None, "r-2", 9)],
        True,
    ),
    (
        "batch-times-n-is-prompt-major",
        {"text": ["a", "b"], "sampling_params": {"n": 2}},
        [("a", None, None, None), ("a", None, None, None), ("b", None, None, None), ("b", None, None, None)],
        True,
    ),
    (
        "n-per-item",
        {"text": ["a", "b"], "rid": ["x", "y"], "sampling_params": [{"n": 2}, {}]},
        [("a", None, "x-0", None), ("a", None, "x-1", None), ("b", None, "y", None)],
        True,
    ),
]


@pytest.mark.parametrize(("fields", "want", "answer_list"), [c[1:] for c in GOOD], ids=[c[0] for c in GOOD])
def test_expansion(fields, want, answer_list):
    reqs, as_list = expand(GenerateCall(**fields), VOCAB)
    got = [(r.text, r.input_ids, r.rid, r.sampling_params.sampling_seed) for r in reqs]
    assert got == want
    assert as_list is answer_list
    assert all(r.sampling_params.n == 1 for r in reqs)  # each engine request is one sample


# (case id, call fields, field the error names, text its message contains)
BAD = [
    ("both-text-and-ids", {"text": "a", "input_ids": [1]}, "text", "exactly one"),
    ("neither-text-nor-ids", {}, "text", "exactly one"),
    ("text-empty", {"text": ""}, "text", "must not be empty"),
    ("text-batch-empty", {"text": []}, "text", "the batch is empty"),
    ("text-batch-item-empty", {"text": ["a", ""]}, "text.1", "must not be empty"),
    ("text-not-a-string", {"text": ["a", 5]}, "text.1", "must be a string"),
    ("ids-empty", {"input_ids": []}, "input_ids", "must not be empty"),
    ("ids-batch-row-empty", {"input_ids": [[1], []]}, "input_ids.1", "must not be empty"),
    ("ids-out-of-vocab", {"input_ids": [1, VOCAB]}, "input_ids[1]", "out of range"),
    ("ids-negative", {"input_ids": [[1], [-1]]}, "input_ids.1[0]", "out of range"),
    ("sampling-bad-field", {"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature", ">= 0"),
    ("sampling-unknown-key", {"text": "a", "sampling_params": {"max_tokens": 5}}, "sampling_params.max_tokens", "unknown"),
    ("sampling-list-mismatch", {"text": ["a", "b", "c"], "sampling_params": [{}, {}]}, "sampling_params", "2 entries for a batch of 3"),
    ("n-zero", {"text": "a", "sampling_params": {"n": 0}}, "sampling_params.n", ">= 1"),
    ("n-over-the-call-limit", {"text": ["a"] * 20, "sampling_params": {"n": 64}}, "sampling_params.n", f"more than {MAX_REQUESTS}"),
    ("seed-overflows-for-sample-1", {"text": "a", "sampling_params": {"n": 2, "sampling_seed": (1 << 63) - 1}}, "sampling_params.sampling_seed", "<="),
    ("rid-list-mismatch", {"text": ["a", "b"], "rid": ["x"]}, "rid", "1 entries for a batch of 2"),
    ("rid-string-for-a-batch", {"text": ["a", "b"], "rid": "x"}, "rid", "1 entries for a batch of 2"),
    ("rid-duplicates", {"text": ["a", "b"], "rid": ["x", "x"]}, "rid", "duplicate request id 'x'"),
    ("rid-duplicate-after-n", {"text": ["a", "b"], "rid": ["x", "x-0"], "sampling_params": [{"n": 2}, {}]}, "rid", "'x-0'"),
    ("return-logprob-list-mismatch", {"text": ["a", "b"], "return_logprob": [True]}, "return_logprob", "1 entries"),
    ("logprob-start-len", {"text": "a", "logprob_start_len": -2}, "logprob_start_len", ">= -1"),
    ("top-logprobs-negative", {"text": "a", "top_logprobs_num": -1}, "top_logprobs_num", "[0, 100]"),
    ("top-logprobs-over-cap", {"text": "a", "top_logprobs_num": 101}, "top_logprobs_num", "[0, 100]"),
    ("token-ids-logprob", {"text": "a", "token_ids_logprob": [VOCAB]}, "token_ids_logprob[0]", "out of range"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "field", "says"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_refusal_names_the_field(fields, field, says):
    with pytest.raises(InvalidRequest) as err:
        expand(GenerateCall(**fields), VOCAB)
    assert err.value.field == field
    assert says in err.value.message


def test_sampling_params_are_built_once_and_shared():
    reqs, _ = expand(GenerateCall(text=["a", "b"], sampling_params={"max_new_tokens": 3}), VOCAB)
    assert reqs[0].sampling_params is reqs[1].sampling_params
    assert reqs[0].sampling_params.max_new_tokens == 3


def test_sampling_params_per_item_one_for_all_and_empty():
    reqs, _ = expand(GenerateCall(text=["a", "b"], sampling_params=[{"max_new_tokens": 1}, None]), VOCAB)
    assert [r.sampling_params.max_new_tokens for r in reqs] == [1, 128]
    reqs, _ = expand(GenerateCall(text=["a", "b"], sampling_params=[{"max_new_tokens": 2}]), VOCAB)
    assert [r.sampling_params.max_new_tokens for r in reqs] == [2, 2]
    reqs, _ = expand(GenerateCall(text=["a", "b"], sampling_params=[]), VOCAB)
    assert all(r.sampling_params == SamplingParams() for r in reqs)


def test_a_built_sampling_params_passes_through():
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    reqs, _ = expand(GenerateCall(input_ids=[1, 2], sampling_params=params), VOCAB)
    assert reqs[0].sampling_params is params


def test_logprob_options_per_item_and_shared():
    reqs, _ = expand(
        GenerateCall(
            text=["a", "b"],
            return_logprob=[True, False],
            logprob_start_len=[0, -1],
            top_logprobs_num=2,
            token_ids_logprob=[[3], [4, 5]],
        ),
        VOCAB,
    )
    assert [(r.return_logprob, r.logprob_start_len, r.top_logprobs_num) for r in reqs] == [(True, 0, 2), (False, -1, 2)]
    assert [r.token_ids_logprob for r in reqs] == [[3], [4, 5]]
    reqs, _ = expand(GenerateCall(text=["a", "b"], token_ids_logprob=[7, 8]), VOCAB)
    assert [r.token_ids_logprob for r in reqs] == [[7, 8], [7, 8]]


def test_call_wide_fields_reach_every_request():
    reqs, _ = expand(
        GenerateCall(
            text=["a", "b"], stream=True, return_text_in_logprobs=True, priority=3, extra_key="k"
        ),
        VOCAB,
    )
    for r in reqs:
        assert (r.stream, r.return_text_in_logprobs, r.priority, r.extra_key) == (True, True, 3, "k")


def test_without_a_vocabulary_ids_are_left_to_the_tokenizer_manager():
    reqs, _ = expand(GenerateCall(input_ids=[10**9]))
    assert reqs[0].input_ids == [10**9]


def test_per_sample():
    assert per_sample(SamplingParams()) == [SamplingParams()]
    samples = per_sample(SamplingParams(n=3, sampling_seed=-1, temperature=0.5))
    assert [(s.n, s.sampling_seed, s.temperature) for s in samples] == [(1, -1, 0.5), (1, 0, 0.5), (1, 1, 0.5)]
    unseeded = per_sample(SamplingParams(n=2))
    assert unseeded[0] is unseeded[1] and unseeded[0].n == 1


def test_entry_points_take_the_same_fields():
    """``GenerateCall``, the route's body and ``Engine.generate`` list the same fields, so the two
    entry points cannot drift apart (``Engine.generate`` calls ``text`` ``prompt``; the route's
    body also declares SGLang's fields that it accepts and does not use)."""
    from phloem.runtime.engine import Engine
    from phloem.runtime.server.protocol import IGNORED_SGLANG_FIELDS, UNSUPPORTED_AT_DEFAULT, GenerateBody

    call = {f.name for f in dataclasses.fields(GenerateCall)}
    sglang_only = set(UNSUPPORTED_AT_DEFAULT) | set(IGNORED_SGLANG_FIELDS)
    assert set(GenerateBody.model_fields) == call | sglang_only and not call & sglang_only
    engine = set(inspect.signature(Engine.generate).parameters) - {"self", "prompt"} | {"text"}
    assert engine == call
