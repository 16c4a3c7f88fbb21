"""``kv_cache_dtype="fp8_e4m3"`` on the default model: what fp8 KV storage costs in accuracy.

One fp8 engine against a float32-KV engine, both on float32 weights (``quantization="none"``),
greedy, same prompts:

- every prompt's first generated token is the same (one may fall on the other side of a
  near-tie), and where fp8's own top choice differs it is within 0.1 nats of the auto token;
- teacher forced over ``prompt + the auto engine's continuation`` (so both score the same text),
  the fp8 engine's logprob of each actual next token stays close and its top-1 token mostly agrees.

fp8 rounds every stored K/V element by up to 2^-4 relative (2.6% rms on this model, nothing near
the +-448 clamp), so greedy continuations of this 135M model drift after a few tokens; the numbers
are in ``docs/benchmarks.md`` ("fp8 KV cache"). Run with ``-s`` to print them.
"""

from __future__ import annotations

import pytest
from phloem.bench.kv_fp8_accuracy import QUESTIONS  # the benchmark's prompts: its numbers and ours agree

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def fp8_engine():
    from phloem import Engine

    eng = Engine(kv_cache_dtype="fp8_e4m3", quantization="none", log_level="warning")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def engine(float_engine):
    """Float32 weights on both sides, so the comparison isolates the KV storage (the default CPU
    path's int8 activations would add their own differences)."""
    return float_engine


def greedy(eng, prompts: list[list[int]]) -> list[list[int]]:
    outs = eng.generate(
        input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}
    )
    return [o["output_ids"] for o in outs]


def scored(eng, ids: list[int]) -> tuple[list[float], list[int], list[float]]:
    """Logprob of every token after the first given the ones before it, and the top-1 token there
    with its logprob."""
    out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                       logprob_start_len=0, top_logprobs_num=1)  # fmt: skip
    logprobs, tops = out["meta_info"]["input_token_logprobs"][1:], out["meta_info"]["input_top_logprobs"][1:]
    return [lp[0] for lp in logprobs], [top[0][1] for top in tops], [top[0][0] for top in tops]


def test_fp8_kv_cache_accuracy_on_the_default_model(engine, fp8_engine) -> None:
    tok = engine.tm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    auto_out, fp8_out = greedy(engine, prompts), greedy(fp8_engine, prompts)
    diffs, agree, positions, first_gaps = [], 0, 0, []
    for prompt, cont in zip(prompts, auto_out):
        (lp_a, top_a, _), (lp_f, top_f, best_f) = (
            scored(engine, prompt + cont),
            scored(fp8_engine, prompt + cont),
        )
        diffs += [abs(a - f) for a, f in zip(lp_a, lp_f)]
        agree += sum(a == f for a, f in zip(top_a, top_f))
        positions += len(top_a)
        first = len(prompt) - 1  # the position that predicts the first generated token
        first_gaps.append(best_f[first] - lp_f[first])  # 0 where fp8's top-1 is auto's token
    first_same = sum(a[0] == f[0] for a, f in zip(auto_out, fp8_out))
    same_tokens = sum(x == y for a, f in zip(auto_out, fp8_out) for x, y in zip(a, f))
    mean_diff = sum(diffs) / len(diffs)
    print(
        f"\nfp8 KV vs auto, {len(prompts)} prompts x {MAX_NEW_TOKENS} greedy tokens: first token same "
        f"{first_same}/{len(prompts)}, same token at same position {same_tokens}/{len(prompts) * MAX_NEW_TOKENS}; "
        f"teacher forced over {positions} positions: mean |dlogprob| {mean_diff:.4f}, max {max(diffs):.4f}, "
        f"top-1 agreement {agree}/{positions}; first-token gaps {[round(g, 3) for g in first_gaps]}"
    )
    assert mean_diff > 0, (
        "fp8 and auto engines gave identical logprobs: kv_cache_dtype did not reach the model runner "
        "(runtime/scheduler/builder.py must pass kv_cache_dtype=args.kv_cache_dtype to ModelRunner)"
    )
    # fp8 may move the first choice only where the two best tokens are nearly tied: teacher
    # forced, its top token is the auto engine's or within 0.1 nats of it (measured: the same
    # token for all eight). One prompt's two best first tokens lie 0.05 nats apart under fp8, and
    # in one run of the full suite the fp8 engine's greedy pass picked the other one (its teacher-
    # forced pass did not), so one greedy disagreement is allowed.
    assert all(gap <= 0.1 for gap in first_gaps), first_gaps
    assert first_same >= len(prompts) - 1  # measured: 8/8, once 7/8
    assert mean_diff < 0.25  # measured: 0.14
    assert agree >= 0.9 * positions  # measured: 362/378
