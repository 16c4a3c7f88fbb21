"""Sampler maths on CPU: greedy, truncation support sets, penalties, bias, bans, bitmask, seeds."""

from __future__ import annotations

import math

import pytest
import torch
from phloem.runtime.forward_io import SamplingInfo
from phloem.runtime.sampling import sampler as sampler_mod
from phloem.runtime.sampling.batch import SamplingBatchBuilder, build_sampling_info
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.sampler import (
    Sampler,
    apply_penalties,
    apply_vocab_mask,
    min_p_drop_mask,
    seeded_uniform,
    token_counts,
    top_k_top_p_drop_mask,
)

V = 16


def info_for(
    params, *, output_ids=None, steps=None, seeds=None, eos=(), vocab=V, vocab_mask=None
) -> SamplingInfo:
    output_ids = output_ids if output_ids is not None else [[] for _ in params]
    return build_sampling_info(
        params,
        output_ids=output_ids,
        vocab_size=vocab,
        seeds=seeds,
        steps=steps,
        eos_token_ids=eos,
        vocab_mask=vocab_mask,
    )


def draws(logits_row: torch.Tensor, p: SamplingParams, n: int = 4000, seed: int = 0) -> torch.Tensor:
    """``n`` independent draws for one row of logits (the row repeated ``n`` times in a batch)."""
    logits = logits_row.unsqueeze(0).repeat(n, 1)
    return Sampler(seed)(logits, info_for([p] * n, vocab=logits.shape[1]))


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


# ---------------------------------------------------------------------- greedy
def test_greedy_fast_path_is_argmax():
    logits = torch.randn(5, V)
    info = info_for([SamplingParams(temperature=0)] * 4 + [SamplingParams(top_k=1)])
    assert info.is_greedy_all
    assert torch.equal(Sampler()(logits, info), logits.argmax(-1))


def test_greedy_rows_in_a_sampled_batch():
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 3
    info = info_for(params)
    assert not info.is_greedy_all
    out = Sampler()(logits, info)
    assert out.dtype == torch.int64 and out.shape == (6,)
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))


def test_step_sampler_takes_the_argmax_only_for_plain_greedy_rows():
    """Continuous decode's per-step sampler: the bare argmax where nothing but the argmax applies,
    the full sampler otherwise (a bias, a ban or a sampled row), with the same draws as a call."""
    logits = torch.randn(4, V)
    plain = info_for([SamplingParams(temperature=0)] * 4)
    assert sampler_mod.plain_greedy(plain)
    assert torch.equal(Sampler().step_sampler(plain)(logits), logits.argmax(-1))
    biased = info_for([SamplingParams(temperature=0, logit_bias={3: 100.0})] * 4)
    banned = info_for(
        [SamplingParams(temperature=0, min_new_tokens=2)] * 4, eos=[int(i) for i in logits.argmax(-1)]
    )
    for info in (biased, banned):
        assert info.is_greedy_all and not sampler_mod.plain_greedy(info)
        assert torch.equal(Sampler().step_sampler(info)(logits), Sampler()(logits, info))
    assert (Sampler().step_sampler(biased)(logits) == 3).all()
    sampled = info_for([SamplingParams(temperature=0.9)] * 4)
    assert not sampler_mod.plain_greedy(sampled)
    assert torch.equal(Sampler(7).step_sampler(sampled)(logits), Sampler(7)(logits, sampled))


def test_input_logits_not_modified():
    logits = torch.randn(3, V)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.5, top_p=0.5, min_p=0.1, logit_bias={1: 3.0}, presence_penalty=1.0)
    ] * 3
    Sampler()(logits, info_for(params, output_ids=[[1, 2]] * 3))
    assert torch.equal(logits, before)


# ---------------------------------------------------------------------- truncation
def test_top_k_support():
    row = log_probs(0.05, 0.3, 0.1, 0.25, 0.2, 0.1)
    got = set(draws(row, SamplingParams(top_k=3)).tolist())
    assert got == {1, 3, 4}


def test_top_p_support():
    row = log_probs(0.5, 0.3, 0.15, 0.05)
    assert set(draws(row, SamplingParams(top_p=0.75)).tolist()) == {0, 1}
    assert set(draws(row, SamplingParams(top_p=0.4)).tolist()) == {0}
    assert set(draws(row, SamplingParams(top_p=1.0)).tolist()) == {0, 1, 2, 3}


def test_top_p_after_top_k_is_renormalized():
    # top-2 leaves [0.4, 0.3] -> [4/7, 3/7]; the mass before rank 1 is 4/7 > 0.5, so only rank 0 stays.
    row = log_probs(0.4, 0.3, 0.2, 0.1)
    assert set(draws(row, SamplingParams(top_k=2, top_p=0.5)).tolist()) == {0}
    assert set(draws(row, SamplingParams(top_k=3, top_p=0.6)).tolist()) == {0, 1}


def test_min_p_support():
    row = log_probs(0.4, 0.3, 0.1, 0.09, 0.11)
    # keep p >= 0.25 * 0.4 = 0.1
    assert set(draws(row, SamplingParams(min_p=0.25)).tolist()) == {0, 1, 2, 4}


def test_drop_masks_match_a_plain_loop():
    torch.manual_seed(1)
    x = torch.randn(8, 12) * 2
    ks = torch.tensor([-1, 1, 3, 12, 5, -1, 2, 7])
    ps = torch.tensor([0.9, 1.0, 0.5, 0.3, 1.0, 0.1, 0.99, 0.7])
    got = top_k_top_p_drop_mask(x, ks, ps)
    for b in range(8):
        order = x[b].argsort(descending=True).tolist()
        k = 12 if ks[b] <= 0 else int(ks[b])
        kept = order[:k]
        q = torch.softmax(x[b, kept], -1).tolist()
        mass, final = 0.0, []
        for tok, prob in zip(kept, q):
            if mass > ps[b] and ps[b] < 1:
                break
            final.append(tok)
            mass += prob
        assert set(final) == {t for t in range(12) if not got[b, t]}
    mins = torch.tensor([0.0, 0.5, 0.05, 1.0, 0.2, 0.0, 0.3, 0.9])
    probs = torch.softmax(x, -1)
    expect = probs < mins.unsqueeze(1) * probs.max(-1, keepdim=True).values
    assert torch.equal(min_p_drop_mask(x, mins), expect)


# ---------------------------------------------------------------------- distribution
def test_temperature_distribution_chi_square():
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    temperature, n = 0.7, 20000
    got = draws(logits, SamplingParams(temperature=temperature), n=n, seed=123)
    observed = torch.bincount(got, minlength=5).double()
    expected = torch.softmax(logits.double() / temperature, -1) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 18.47  # chi-square, 4 degrees of freedom, p = 0.001


def test_seeded_draws_follow_the_distribution():
    # One seeded request over many steps: the hash noise must behave like uniform noise.
    logits = torch.tensor([0.5, 1.5, -1.0, 0.0])
    n = 8000
    p = SamplingParams(temperature=1.0, sampling_seed=99)
    info = info_for([p] * n, steps=list(range(n)), vocab=4)
    got = Sampler()(logits.repeat(n, 1), info)
    observed = torch.bincount(got, minlength=4).double()
    expected = torch.softmax(logits.double(), -1) * n
    assert float(((observed - expected) ** 2 / expected).sum()) < 16.27  # 3 dof, p = 0.001


def test_seeded_uniform_range_and_spread():
    u = seeded_uniform(torch.tensor([0, 1, 2**62]), torch.tensor([0, 5, 7]), 4096)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.02
    assert not torch.equal(u[0], u[1])


# ---------------------------------------------------------------------- seeds
def test_seeded_row_is_independent_of_batch():
    torch.manual_seed(0)
    target = torch.randn(V)
    p = SamplingParams(temperature=1.3, top_p=0.95, sampling_seed=1234)
    alone = Sampler(seed=1)(target.unsqueeze(0), info_for([p], steps=[17]))
    for position, size, sampler_seed in ((0, 4, 2), (3, 4, 3), (5, 9, 4)):
        logits = torch.randn(size, V)
        logits[position] = target
        if size == 4:  # neighbours seeded differently
            params = [SamplingParams(temperature=0.8, top_k=5, sampling_seed=s) for s in range(size)]
        else:  # unseeded neighbours
            params = [SamplingParams(temperature=0.9)] * size
        params[position] = p
        steps = [3] * size
        steps[position] = 17
        out = Sampler(seed=sampler_seed)(logits, info_for(params, steps=steps))
        assert int(out[position]) == int(alone[0])


def test_seed_and_step_change_the_draw():
    logits = torch.zeros(1, 1000)  # uniform over 1000 tokens
    outs = {
        int(Sampler()(logits, info_for([SamplingParams(sampling_seed=s)], steps=[t], vocab=1000))[0])
        for s in range(5)
        for t in range(5)
    }
    assert len(outs) > 15


def test_explicit_seeds_override_params():
    logits = torch.zeros(2, 1000)
    p = SamplingParams(sampling_seed=5)
    same = Sampler()(logits, info_for([p, p], steps=[0, 0], vocab=1000))
    assert same[0] == same[1]
    differ = Sampler()(logits, info_for([p, p], steps=[0, 0], seeds=[5, 6], vocab=1000))
    assert differ[0] != differ[1]


def test_unseeded_rows_use_the_sampler_generator():
    logits = torch.zeros(4, 1000)
    info = info_for([SamplingParams()] * 4, vocab=1000)
    assert torch.equal(Sampler(seed=7)(logits, info), Sampler(seed=7)(logits, info))


# ---------------------------------------------------------------------- penalties, bias, bans
def test_penalties_match_a_plain_loop():
    torch.manual_seed(2)
    logits = torch.randn(3, V) * 3
    counts = torch.randint(0, 3, (3, V), dtype=torch.int32)
    freq, pres, rep = (
        torch.tensor([0.5, 0.0, -1.0]),
        torch.tensor([0.3, 1.0, 0.0]),
        torch.tensor([1.5, 1.0, 0.8]),
    )
    got = apply_penalties(logits, counts, frequency=freq, presence=pres, repetition=rep)
    for b in range(3):
        for t in range(V):
            x, c = float(logits[b, t]), int(counts[b, t])
            if c > 0:
                x = x / float(rep[b]) if x > 0 else x * float(rep[b])
            x -= c * float(freq[b]) + (c > 0) * float(pres[b])
            assert math.isclose(float(got[b, t]), x, rel_tol=1e-5, abs_tol=1e-5)


def test_token_counts_from_padded_ids():
    ids = torch.tensor([[1, 1, 3, -1], [-1, -1, -1, -1], [0, 15, 15, 15]])
    counts = token_counts(ids, V)
    assert counts.dtype == torch.int32 and counts.shape == (3, V)
    assert counts[0, 1] == 2 and counts[0, 3] == 1 and counts[0].sum() == 3
    assert counts[1].sum() == 0
    assert counts[2, 15] == 3 and counts[2, 0] == 1


def test_penalties_through_the_sampler():
    logits = torch.zeros(2, V)
    logits[:, 4] = 1.0  # the favourite, already generated by row 0
    logits[:, 5] = 0.9
    params = [SamplingParams(temperature=0, presence_penalty=0.5), SamplingParams(temperature=0)]
    info = info_for(params, output_ids=[[4, 4], [4]])
    assert info.output_ids is not None and info.output_ids.shape == (2, 2)
    assert Sampler()(logits, info).tolist() == [5, 4]
    dense = SamplingInfo(
        **{**vars(info), "output_ids": None, "output_token_counts": token_counts(info.output_ids, V)}
    )
    assert Sampler()(logits, dense).tolist() == [5, 4]


def test_repetition_penalty_divides_and_multiplies():
    logits = torch.tensor([[2.0, -1.0, 1.5, -3.0]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    info = info_for([p], output_ids=[[0, 1]], vocab=4)
    x = sampler_mod.process_logits(logits, info)
    assert x.tolist() == [[1.0, -2.0, 1.5, -3.0]]


def test_a_tiny_repetition_penalty_never_lets_a_masked_token_be_drawn():
    """logit / 1e-62 overflows to +inf; softmax over it would be NaN and could draw any token."""
    logits = torch.full((1, V), 3.0)
    mask = torch.zeros(1, 1, dtype=torch.int32)
    mask[0, 0] = (1 << 4) | (1 << 5)  # the grammar allows tokens 4 and 5 only
    p = SamplingParams(temperature=0.7, repetition_penalty=1e-62, sampling_seed=1)
    for seen in ([4], [4, 5], [7]):
        info = info_for([p], output_ids=[seen], vocab_mask=mask)
        x = sampler_mod.process_logits(logits, info)
        assert not torch.isnan(x).any() and not torch.isposinf(x).any()
        for step in range(20):
            info = info_for([p], output_ids=[seen], vocab_mask=mask, steps=[step])
            assert Sampler()(logits, info).item() in (4, 5)


def test_logit_bias():
    logits = torch.zeros(2, V)
    params = [
        SamplingParams(temperature=0, logit_bias={9: 5.0}),
        SamplingParams(temperature=0, logit_bias={"3": 1}),
    ]
    assert Sampler()(logits, info_for(params)).tolist() == [9, 3]
    # a strong negative bias removes a token from sampling
    biased = draws(torch.zeros(4), SamplingParams(logit_bias={2: -1e9}), n=500)
    assert 2 not in set(biased.tolist())


def test_min_new_tokens_bans_eos_and_stop_ids():
    logits = torch.zeros(3, V)
    logits[:, 2] = 10.0  # EOS is the favourite
    logits[:, 7] = 9.0  # then a stop id
    p = SamplingParams(temperature=0, min_new_tokens=3, stop_token_ids=[7])
    info = info_for(
        [p, p, SamplingParams(temperature=0, min_new_tokens=3, ignore_eos=True, stop_token_ids=[7])],
        steps=[0, 3, 1],
        eos=[2],
    )
    assert info.banned_mask is not None
    # row 0: EOS and 7 banned, the rest tie at 0 -> token 0; row 1: floor reached; row 2: EOS allowed
    assert Sampler()(logits, info).tolist() == [0, 2, 2]


def test_no_bans_once_min_new_tokens_reached():
    p = SamplingParams(temperature=0, min_new_tokens=2)
    assert info_for([p], steps=[2], eos=[2]).banned_mask is None


# ---------------------------------------------------------------------- grammar bitmask
def _mask_allowing(rows: list[set[int]], vocab: int) -> torch.Tensor:
    words = (vocab + 31) // 32
    mask = torch.zeros(len(rows), words, dtype=torch.int32)
    for b, allowed in enumerate(rows):
        for t in allowed:
            w, j = divmod(t, 32)
            mask[b, w] |= -(1 << 31) if j == 31 else 1 << j
    return mask


def test_bitmask_restricts_greedy_and_sampling():
    vocab = 70
    allowed = [{0, 31, 33}, {63, 64, 69}]
    mask = _mask_allowing(allowed, vocab)
    logits = torch.randn(2, vocab)
    info = info_for([SamplingParams(temperature=0)] * 2, vocab=vocab, vocab_mask=mask)
    out = Sampler()(logits, info).tolist()
    for b in range(2):
        best = max(allowed[b], key=lambda t: float(logits[b, t]))
        assert out[b] == best
    n = 600
    info = info_for([SamplingParams()] * n, vocab=vocab, vocab_mask=mask[1:].repeat(n, 1))
    assert set(Sampler()(torch.zeros(n, vocab), info).tolist()) == allowed[1]


def test_local_bitmask_fallback_matches(monkeypatch):
    vocab = 100  # wider than 3 words = 96 tokens: extra columns are disallowed
    mask = torch.randint(-(2**31), 2**31 - 1, (4, 3), dtype=torch.int32)
    logits = torch.randn(4, vocab)
    shared = apply_vocab_mask(logits.clone(), mask)
    monkeypatch.setattr(sampler_mod, "_apply_bitmask_inplace", None)
    local = apply_vocab_mask(logits.clone(), mask)
    assert torch.equal(shared, local)
    assert torch.isinf(local[:, 96:]).all()
    for b in range(4):
        for t in range(96):
            w, j = divmod(t, 32)
            assert bool(torch.isinf(local[b, t])) == (not (int(mask[b, w]) >> j) & 1)


# ---------------------------------------------------------------------- batch builder
def test_builder_caches_static_columns_for_the_same_batch():
    builder = SamplingBatchBuilder(V, eos_token_ids=[2])
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=0)]
    a = builder.build_from(params, output_ids=[[], []])
    b = builder.build_from(params, output_ids=[[1], [1]])
    assert a.temperatures is b.temperatures
    c = builder.build_from(params[::-1], output_ids=[[], []])
    assert c.temperatures.tolist() == [0.0, 0.5]


def test_builder_output_ids_follow_growing_lists():
    builder = SamplingBatchBuilder(V)
    params = [SamplingParams(frequency_penalty=0.5), SamplingParams(), SamplingParams(presence_penalty=1.0)]
    outs: list[list[int]] = [[], [9], [1, 2]]
    seen = []
    for step in range(150):  # grows past the initial buffer width
        outs[0].append(step % V)
        outs[2].append((3 * step) % V)
        info = builder.build_from(params, output_ids=outs)
        seen.append(info.output_ids)
        assert info.output_ids[0, : len(outs[0])].tolist() == outs[0]
        assert info.output_ids[2, : len(outs[2])].tolist() == outs[2]
        assert (info.output_ids[1] == -1).all()
    assert seen[0].shape == (3, 3) and seen[0][0, 1] == -1  # earlier tensors are never written to
    outs[2] = [4]  # a new list object (e.g. a replaced request row) is rewritten
    info = builder.build_from(params, output_ids=outs)
    assert info.output_ids[2, :2].tolist() == [4, -1]


def test_builder_hints_and_fast_path():
    info = info_for([SamplingParams(temperature=0)] * 3)
    assert info.is_greedy_all and info.logit_bias is None and info.output_ids is None and info.seeds is None
    info = info_for([SamplingParams(temperature=0.7), SamplingParams(temperature=0, top_p=0.5)])
    assert not info.use_top_k_top_p and not info.use_min_p
    info = info_for([SamplingParams(top_k=5), SamplingParams(min_p=0.1)])
    assert info.use_top_k_top_p and info.use_min_p


def test_builder_reads_scheduler_requests():
    class Row:
        def __init__(self, params, output_ids, launched):
            self.params, self.output_ids, self.num_outputs_launched = params, output_ids, launched

    builder = SamplingBatchBuilder(V, eos_token_ids=[2])
    p = SamplingParams(sampling_seed=3, min_new_tokens=2)
    info = builder.build([Row(p, [5], 2), Row(p, [5], 1)])
    assert info.steps.tolist() == [2, 1]
    assert info.banned_mask[1, 2] and not info.banned_mask[0].any()


@pytest.mark.parametrize("seed", [0, -1, (1 << 63) - 1, -(1 << 63)])
def test_any_seed_is_accepted(seed):
    info = info_for([SamplingParams(sampling_seed=seed)])
    assert int(info.seeds[0]) >= 0
    Sampler()(torch.randn(1, V), info)


def test_builder_build_matches_build_from_with_every_column_given():
    """``build`` skips the per-row lists a batch does not need; the result is the one
    ``build_from`` gives with steps, seeds and output ids all passed."""
    import random

    class Row:
        def __init__(self, params, output_ids, launched):
            self.params, self.output_ids, self.num_outputs_launched = params, output_ids, launched

    rng = random.Random(0)
    kinds = [dict(), dict(temperature=0), dict(sampling_seed=5), dict(min_new_tokens=3),
             dict(min_new_tokens=2, stop_token_ids=[4]), dict(frequency_penalty=0.5), dict(logit_bias={3: 1.0})]  # fmt: skip
    for _ in range(40):
        params = [SamplingParams(**rng.choice(kinds)) for _ in range(rng.randint(1, 5))]
        rows = [Row(p, [rng.randrange(V) for _ in range(rng.randint(0, 4))], 0) for p in params]
        for r in rows:
            r.num_outputs_launched = len(r.output_ids) + rng.randint(0, 1)
        got = SamplingBatchBuilder(V, eos_token_ids=[2]).build(rows)
        want = SamplingBatchBuilder(V, eos_token_ids=[2]).build_from(
            params,
            output_ids=[r.output_ids for r in rows],
            seeds=[p.sampling_seed for p in params],
            steps=[r.num_outputs_launched for r in rows],
        )
        for name, a in vars(got).items():
            b = getattr(want, name)
            assert type(a) is type(b), name
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name
