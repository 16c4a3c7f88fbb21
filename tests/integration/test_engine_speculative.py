"""Speculative decoding through the Engine on the default model with the shipped EAGLE head and
with n-gram drafts: 12 prompts x 64 tokens in one batch of mixed lengths, some with stop strings and
some constrained by a JSON schema, give the same token ids as plain greedy decoding, with float32
weights (``quantization="none"``) and with the CPU default (``auto``: the GGUF's blocks with int8
activations, where a verify pass must compute every draft token in the same float order as a decode
step, or a rounding difference would change a token now and then)."""

from __future__ import annotations

import json

import pytest

from phloem import Engine

PROMPTS = [
    "List the days of the week:",
    "Count from one to twenty: one, two,",
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Repeat after me: the cat sat on the mat. The cat sat on the mat. The cat",
    "Explain in two sentences why the sky is blue, for a child who asked at breakfast.",
    "Name three planets.",
    "Give a recipe for pancakes with a list of ingredients and numbered steps.",
    "Translate to French: good morning, my friend.",
    "Describe a person called Ada as JSON.",
    "A JSON record of a city:",
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
GREEDY = {"max_new_tokens": 64, "temperature": 0}
PARAMS = [dict(GREEDY) for _ in PROMPTS]
for i, stop in [(1, " ten"), (3, "\n\n"), (8, "3."), (9, ["!", "ami"])]:
    PARAMS[i]["stop"] = stop
for i in (10, 11):
    PARAMS[i]["json_schema"] = json.dumps(SCHEMA)
CONSTRAINED = (10, 11)


@pytest.fixture(scope="module", params=["none", "auto"])
def quantization(request):
    return request.param


@pytest.fixture(scope="module")
def reference(quantization):
    with Engine(log_level="warning", disable_overlap_schedule=True, quantization=quantization) as eng:
        return eng.generate(PROMPTS, sampling_params=PARAMS)


def test_reference_exercises_what_it_claims(reference):
    lengths = [o["meta_info"]["completion_tokens"] for o in reference]
    assert max(lengths) == 64 and min(lengths) < 32  # lengths in the batch differ
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for i, o in enumerate(reference)
               if "stop" in PARAMS[i])  # fmt: skip
    for i in CONSTRAINED:
        assert set(json.loads(reference[i]["text"])) == {"name", "age"}


@pytest.mark.parametrize("algo", ["EAGLE", "NGRAM"])
def test_speculative_greedy_equals_target_greedy(reference, quantization, algo):
    with Engine(speculative_algorithm=algo, quantization=quantization, log_level="warning") as eng:
        outs = eng.generate(PROMPTS, sampling_params=PARAMS)
        for i, (got, want) in enumerate(zip(outs, reference)):
            assert got["output_ids"] == want["output_ids"], f"prompt {i}: {PROMPTS[i]!r}"
            assert got["text"] == want["text"]
            assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        metas = [o["meta_info"] for o in outs if o["meta_info"]["completion_tokens"] > 2]
        assert all(m["spec_verify_ct"] > 0 and m["spec_accept_length"] >= 1.0 for m in metas)
        assert all(outs[i]["meta_info"]["spec_verify_ct"] > 0 for i in CONSTRAINED)  # not plain steps
        assert max(m["spec_accept_length"] for m in metas) > 1.0  # some drafts were accepted
        assert all(0.0 <= m["spec_accept_rate"] <= 1.0 for m in metas)
        assert eng.flush_cache()


FREE = [i for i in range(len(PROMPTS)) if i not in CONSTRAINED]


def test_speculative_windows_equal_target_greedy(reference, quantization):
    """``num_continuous_decode_steps=4`` with the default EAGLE chain: greedy rows run windows of
    four speculative steps on the device per host sync (constrained rows keep single steps, and
    hold the whole batch to them while they run); stop strings cut outputs inside a window;
    sampled rows take windows too."""
    with Engine(speculative_algorithm="EAGLE", num_continuous_decode_steps=4, quantization=quantization,
                log_level="warning") as eng:  # fmt: skip
        mixed = eng.generate(PROMPTS, sampling_params=PARAMS)
        free = eng.generate([PROMPTS[i] for i in FREE], sampling_params=[PARAMS[i] for i in FREE])
        windows = eng.get_server_info()["live"]["spec_window_steps_total"]
        single = eng.generate(PROMPTS[5], sampling_params=GREEDY)
        # sampled rows take windows too (speculative sampling on the device)
        before = eng.get_server_info()["live"]["spec_window_steps_total"]
        sampled = eng.generate(
            PROMPTS[:4], sampling_params={"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 32}
        )
        sampled_windows = eng.get_server_info()["live"]["spec_window_steps_total"] - before
    for got, want in zip([*mixed, *free, single], [*reference, *(reference[i] for i in FREE), reference[5]]):
        assert got["output_ids"] == want["output_ids"]
        assert got["text"] == want["text"]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert windows > 0
    assert single["meta_info"]["spec_accept_length"] > 1.5  # a repetitive prompt: long chains accepted
    assert all(
        o["meta_info"].get("spec_verify_ct", 0) > 0 for o in free if o["meta_info"]["completion_tokens"] > 2
    )
    assert sampled_windows > 0
    lengths = [o["meta_info"]["completion_tokens"] for o in sampled]
    assert all(o["meta_info"]["finish_reason"]["type"] in ("length", "stop") for o in sampled)
    assert max(lengths) == 32 and all(1 <= n <= 32 for n in lengths)
    assert all(
        o["meta_info"]["spec_verify_ct"] > 0 for o in sampled if o["meta_info"]["completion_tokens"] > 2
    )
