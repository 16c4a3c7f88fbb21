"""Speculative decoding through the Engine on the default model with the shipped EAGLE head:
greedy output identical to the target's, in a batch of mixed lengths, with stop strings."""

from __future__ import annotations

import pytest

from phloem import Engine

PROMPTS = [
    "List the days of the week:",
    "Count from one to twenty: one, two,",
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Repeat after me: the cat sat on the mat. The cat sat on the mat. The cat",
]
GREEDY = {"max_new_tokens": 48, "temperature": 0}


@pytest.fixture(scope="module")
def reference():
    with Engine(log_level="warning", disable_overlap_schedule=True) as eng:
        plain = eng.generate(PROMPTS, sampling_params=GREEDY)
        stopped = eng.generate(PROMPTS[1], sampling_params={**GREEDY, "stop": " ten"})
    return plain, stopped


@pytest.mark.parametrize("algo", ["EAGLE", "NGRAM"])
def test_speculative_greedy_equals_target_greedy(reference, algo):
    plain, stopped = reference
    with Engine(speculative_algorithm=algo, log_level="warning", disable_overlap_schedule=True) as eng:
        outs = eng.generate(PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
        metas = [o["meta_info"] for o in outs if o["meta_info"]["completion_tokens"] > 2]
        assert all(m["spec_verify_ct"] > 0 and m["spec_accept_length"] >= 1.0 for m in metas)
        assert max(m["spec_accept_length"] for m in metas) > 1.0  # some drafts were accepted
        assert all(0.0 <= m["spec_accept_rate"] <= 1.0 for m in metas)
        s = eng.generate(PROMPTS[1], sampling_params={**GREEDY, "stop": " ten"})
        assert s["text"] == stopped["text"] and s["meta_info"]["finish_reason"] == stopped["meta_info"]["finish_reason"]
        assert eng.flush_cache()
