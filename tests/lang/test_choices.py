"""Select scoring maths (pure) and select() end to end on the fake engine."""

from __future__ import annotations

import math
import random

import pytest
from phloem.lang.choices import (
    ChoiceLogprobs,
    greedy_index,
    greedy_token_selection,
    healed_boundary,
    resolve_method,
    softmax,
    tail_logprobs,
    token_length_normalized,
    unconditional_likelihood_normalized,
)

import phloem as ph

LP = ChoiceLogprobs(
    conditional=((-1.0, -1.0), (-0.5, -3.0, -3.0), (-2.0,)), unconditional=((-4.0, -4.0), (-1.0,), (-1.0,))
)


def test_token_length_normalized_is_the_mean():
    d = token_length_normalized.decide(LP)
    assert d.scores == (-1.0, pytest.approx(-6.5 / 3), -2.0)
    assert d.index == 0 and d.method == "token_length_normalized"


def test_greedy_follows_the_best_first_token():
    d = greedy_token_selection.decide(LP)
    assert d.index == 1  # -0.5 is the best first token, although its mean is the worst


@pytest.mark.parametrize(
    ("conditional", "expected"),
    [
        (((-1.0, -2.0), (-1.0, -0.5)), 1),  # tie on the first token, second decides
        (((-1.0,), (-1.0, -5.0)), 0),  # shorter continues with its mean (-1) > -5
        (((-1.0,), (-1.0, -0.1)), 1),
        (((-1.0, -1.0), (-1.0, -1.0)), 0),  # full tie: first
    ],
)
def test_greedy_table(conditional, expected):
    assert greedy_index(conditional) == expected


def test_unconditional_normalized_subtracts_context_free_likelihood():
    d = unconditional_likelihood_normalized.decide(LP)
    assert d.scores == (6.0, -5.5, -1.0)
    assert d.index == 0
    with pytest.raises(ValueError):
        unconditional_likelihood_normalized.scores(ChoiceLogprobs(conditional=((-1.0,),)))


def test_temperature_samples_from_softmax():
    rng = random.Random(0)
    lp = ChoiceLogprobs(conditional=((-1.0,), (-1.0 + math.log(3.0),)))
    picks = [token_length_normalized.decide(lp, temperature=1.0, rng=rng).index for _ in range(4000)]
    assert picks.count(1) / len(picks) == pytest.approx(0.75, abs=0.03)


def test_softmax_handles_minus_infinity():
    assert softmax([-math.inf, -math.inf], temperature=1.0) == [0.5, 0.5]
    assert softmax([0.0, -math.inf], temperature=0.5) == [1.0, 0.0]


def test_healed_boundary_and_tail():
    assert healed_boundary([1, 5, 6], [1, 5, 6, 7]) == 3
    assert healed_boundary([1, 5, 6], [1, 5, 9, 7]) == 2  # the last prefix token merged
    entries = [[None, 1, "<s>"], [-1.0, 5, "a"], [-2.0, 9, "b"]]
    assert tail_logprobs(entries, 2) == (-1.0, -2.0)
    assert tail_logprobs(entries, 5) == (-1.0, -2.0)
    assert tail_logprobs(entries, 0) == ()


def test_resolve_method_by_name():
    assert resolve_method("greedy_token_selection") is greedy_token_selection
    assert resolve_method(None) is token_length_normalized
    with pytest.raises(ValueError, match="unknown"):
        resolve_method("nope")


# -- end to end on the fake engine ------------------------------------------------------------------


def _select_program(method):
    @ph.function
    def prog(s):
        s += "The answer is "
        s += ph.select("a", choices=["yes", "no way", "maybe"], choices_method=method)

    return prog


def test_select_scores_in_one_batched_prefill(backend, engine):
    # Likelihood per token: " no" is very likely, " way" unlikely.
    table = {" yes": -1.0, " no": -0.2, " way": -4.0, " maybe": -2.0}
    engine.logprob = lambda ctx, tok: table.get(tok, -9.0)
    state = _select_program(ph.token_length_normalized).run(backend=backend)
    assert state.error() is None
    assert state["a"] == "yes"
    assert state.text() == "The answer is yes"
    meta = state.get_meta_info("a")
    assert meta["scores"] == [-1.0, pytest.approx(-2.1), -2.0]
    # token healing: "is " + "yes" tokenizes as "is", " yes"; the merged token is scored.
    assert meta["conditional_logprobs"] == [[-1.0], [-0.2, -4.0], [-2.0]]
    scoring = [c for c in engine.calls if isinstance(c["prompt"], list)]
    assert len(scoring) == 1
    call = scoring[0]
    assert call["prompt"] == ["The answer is yes", "The answer is no way", "The answer is maybe"]
    assert call["sampling_params"] == {"max_new_tokens": 0}
    assert call["return_logprob"] is True
    prefix_len = len(engine.ids("The answer is "))  # BOS + 4 tokens, the last (" ") merges
    assert 0 < call["logprob_start_len"] < prefix_len - 1


def test_select_greedy_method(backend, engine):
    table = {" yes": -1.0, " no": -0.2, " way": -4.0, " maybe": -2.0}
    engine.logprob = lambda ctx, tok: table.get(tok, -9.0)
    state = _select_program(ph.greedy_token_selection).run(backend=backend)
    assert state["a"] == "no way"


def test_select_unconditional_sends_context_free_request(backend, engine):
    def logprob(ctx, tok):
        conditional = bool(ctx)  # the unconditional request has no context before the choice
        return (
            {" yes": -3.0, "yes": -0.5, " maybe": -2.5, "maybe": -5.0}.get(tok, -1.0)
            if conditional or tok in ("yes", "maybe")
            else -1.0
        )

    engine.logprob = logprob
    state = _select_program(ph.unconditional_likelihood_normalized).run(backend=backend)
    meta = state.get_meta_info("a")
    assert meta["unconditional_logprobs"] is not None
    assert state["a"] == "maybe"  # -2.5 - (-5.0) is the largest gain
    lists = [c["prompt"] for c in engine.calls if isinstance(c["prompt"], list)]
    assert ["yes", "no way", "maybe"] in lists


def test_select_temperature_zero_is_deterministic(backend, engine):
    engine.logprob = lambda ctx, tok: -1.0 if tok.strip() == "maybe" else -2.0
    picks = {_select_program(ph.token_length_normalized).run(backend=backend)["a"] for _ in range(3)}
    assert picks == {"maybe"}


def test_select_validation():
    with pytest.raises(ValueError):
        ph.select("a", choices=[])
    with pytest.raises(ValueError):
        ph.select("a", choices=["x"], temperature=-1)
