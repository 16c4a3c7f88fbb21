"""Continuous decode through the Engine on the default model: with
``num_continuous_decode_steps=4`` (and a step-time budget wide enough never to bind) the 12 prompts of the speculative test (mixed lengths, stop
strings, two rows constrained by a JSON schema) give the token ids of one-step decoding; without
the constrained rows the batch runs mostly continuous batches, and still gives the same ids."""

from __future__ import annotations

import pytest

from phloem import Engine
from tests.integration.test_engine_speculative import CONSTRAINED, PARAMS, PROMPTS

FREE = [i for i in range(len(PROMPTS)) if i not in CONSTRAINED]
STREAM = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def _generate(**kw):
    with Engine(log_level="warning", **kw) as eng:
        mixed = eng.generate(PROMPTS, sampling_params=PARAMS)
        steps_mixed = eng.get_server_info()["live"]["continuous_decode_steps_total"]
        free = eng.generate([PROMPTS[i] for i in FREE], sampling_params=[PARAMS[i] for i in FREE])
        steps_all = eng.get_server_info()["live"]["continuous_decode_steps_total"]
        chunks = list(eng.generate(PROMPTS[1], sampling_params=STREAM, stream=True))
        return mixed, free, steps_mixed, steps_all, chunks


@pytest.fixture(scope="module")
def runs():
    # the default is auto, which the CPU resolves to one step per launch; the second engine takes 4
    # steps per launch under a budget that never binds once a step was timed (the first decode
    # launch after start-up, untimed, has one step)
    return _generate(), _generate(num_continuous_decode_steps=4, continuous_decode_budget_ms=60_000.0)


def test_continuous_decode_gives_the_one_step_tokens(runs):
    (mixed_ref, free_ref, _, zero, _), (mixed, free, _, _, _) = runs
    assert zero == 0
    for got, want in zip([*mixed, *free], [*mixed_ref, *free_ref]):
        assert got["output_ids"] == want["output_ids"]
        assert got["text"] == want["text"]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    stops = [o["meta_info"]["finish_reason"]["type"] for o in free]
    assert "stop" in stops and "length" in stops


def test_continuous_batches_ran_and_constrained_rows_kept_single_steps(runs):
    _, (_, free, steps_mixed, steps_all, _) = runs
    longest = max(o["meta_info"]["completion_tokens"] for o in free)
    # the second call's rows decode mostly in batches of four steps (a batch ends early only where
    # a row has fewer than four tokens left)
    assert steps_all - steps_mixed >= 0.6 * (longest - 1)


def test_bad_step_count_and_budget_are_refused():
    with pytest.raises(ValueError, match="num-continuous-decode-steps"):
        Engine(num_continuous_decode_steps=-1)
    with pytest.raises(ValueError, match="continuous-decode-budget-ms"):
        Engine(continuous_decode_budget_ms=-2.0)


def test_streaming_sends_the_tokens_of_a_batch_together(runs):
    """A stream gets up to four tokens per chunk; the chunks add up to the one-step stream's text."""
    (*_, ref_chunks), (*_, chunks) = runs
    assert chunks[-1]["text"] == ref_chunks[-1]["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert 2 <= len(chunks) < len(ref_chunks)
