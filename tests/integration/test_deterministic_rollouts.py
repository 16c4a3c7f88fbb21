"""Reproducible sampled rollouts with the radix cache on (the default model, CPU).

A request with a ``sampling_seed`` draws its noise from ``(seed, step, token)`` alone, so its draw
never depends on its neighbours; ``--enable-deterministic-inference`` makes the logits themselves
independent of the batch and of how much of the prompt came from the cache. Together: the same
seeded request gives the same tokens and the same logprobs, bit for bit, alone, inside a batch of
other requests, and when its prefix is read back from the radix cache.
"""

from __future__ import annotations

import pytest

from phloem import Engine

pytestmark = pytest.mark.slow

PROMPT = "The reason the sky looks blue on a clear day is that"
SEEDED = {"max_new_tokens": 32, "temperature": 0.7, "top_p": 0.9, "sampling_seed": 77}
OTHERS = [f"Write item {i} of a shopping list with {i} words:" * (1 + i % 3) for i in range(11)]
# neighbours of every kind: unseeded sampled, greedy, seeded with other seeds, penalized
OTHER_PARAMS = [
    {"max_new_tokens": 20, "temperature": 1.0},
    {"max_new_tokens": 12, "temperature": 0},
    {"max_new_tokens": 40, "temperature": 0.9, "sampling_seed": 5},
    {"max_new_tokens": 16, "temperature": 0.8, "frequency_penalty": 0.5},
]


def _rollout(out: dict) -> tuple[list[int], list[float]]:
    return out["output_ids"], [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def test_seeded_rollout_is_the_same_alone_in_a_batch_and_from_the_cache():
    with Engine(enable_deterministic_inference=True, log_level="warning") as eng:
        # in a batch first, on an empty cache: the whole prompt is computed with the others
        prompts = OTHERS[:5] + [PROMPT] + OTHERS[5:]
        params = [OTHER_PARAMS[i % len(OTHER_PARAMS)] for i in range(len(OTHERS))]
        params = params[:5] + [SEEDED] + params[5:]
        batch = eng.generate(prompts, sampling_params=params, return_logprob=True)[5]
        assert batch["meta_info"]["cached_tokens"] == 0
        in_batch = _rollout(batch)
        assert len(in_batch[0]) > 8

        assert eng.flush_cache()
        alone = eng.generate(PROMPT, sampling_params=SEEDED, return_logprob=True)
        assert alone["meta_info"]["cached_tokens"] == 0
        assert _rollout(alone) == in_batch

        # the prompt now comes from the radix cache; the rest is computed on top of it
        cached = eng.generate(PROMPT, sampling_params=SEEDED, return_logprob=True)
        assert cached["meta_info"]["cached_tokens"] > 0
        assert _rollout(cached) == in_batch

        # cached and batched at once
        again = eng.generate(
            [*OTHERS[:3], PROMPT], sampling_params=[*OTHER_PARAMS[:3], SEEDED], return_logprob=True
        )[3]
        assert again["meta_info"]["cached_tokens"] > 0
        assert _rollout(again) == in_batch

        # and the seed is what fixes the draw: another seed gives another rollout
        other = eng.generate(PROMPT, sampling_params={**SEEDED, "sampling_seed": 78}, return_logprob=True)
        assert _rollout(other)[0] != in_batch[0]
