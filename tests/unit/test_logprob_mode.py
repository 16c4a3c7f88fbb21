"""The two logprob modes at the sampler and model-runner level: ``raw`` reads the model's own
``log_softmax(logits)``; ``processed`` reads the distribution the token was drawn from (after
penalties, logit bias, masks, temperature and top-k/top-p/min-p)."""

from __future__ import annotations

import types

import pytest
import torch
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.executor.model_runner import ModelRunner, _LogitRows
from phloem.runtime.forward_io import LogprobRequest
from phloem.runtime.sampling.batch import build_sampling_info
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.sampler import Sampler

V = 12


def info_for(params, output_ids=None, steps=None):
    return build_sampling_info(
        params,
        output_ids=output_ids or [[] for _ in params],
        vocab_size=V,
        steps=steps,
        eos_token_ids=(),
    )


def test_logprob_mode_field():
    assert SamplingParams().logprob_mode == "raw"
    p = SamplingParams.from_wire({"logprob_mode": "processed"})
    assert p.logprob_mode == "processed"
    assert SamplingParams.from_wire(p.to_wire()) == p
    assert SamplingParams().to_wire() == {}
    for bad in ("softmax", "", 1, ["raw"]):
        with pytest.raises(InvalidRequest, match="sampling_params.logprob_mode"):
            SamplingParams.from_wire({"logprob_mode": bad})
    assert SamplingParams.from_wire({"logprob_mode": None}).logprob_mode == "raw"


def test_sampled_row_logits_are_scaled_truncated_and_penalized():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, sampling_seed=5),
        SamplingParams(temperature=0.7, presence_penalty=0.5, logit_bias={3: 2.0}, sampling_seed=6),
        SamplingParams(temperature=0),
    ]
    info = info_for(params, output_ids=[[], [1, 1], []], steps=[4, 4, 4])
    tokens, drawn = Sampler().sample_with_logits(logits, info)
    # the same draws as the plain call: reporting the distribution changes no token
    again = Sampler()(logits, info_for(params, output_ids=[[], [1, 1], []], steps=[4, 4, 4]))
    assert tokens.tolist() == again.tolist()

    # row 0: temperature, then the top-p nucleus of the scaled row
    scaled = logits[0] / 0.7
    probs = torch.softmax(scaled, -1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    kept = set(order[before <= 0.9].tolist())
    expect = torch.full((V,), float("-inf"))
    expect[list(kept)] = scaled[list(kept)]
    assert torch.equal(torch.isinf(drawn[0]), torch.isinf(expect))
    torch.testing.assert_close(drawn[0][list(kept)], expect[list(kept)])
    assert int(tokens[0]) in kept

    # row 1: logit bias and presence penalty, then temperature (no truncation)
    row = logits[1].clone()
    row[3] += 2.0
    row[1] -= 0.5
    torch.testing.assert_close(drawn[1], row / 0.7)

    # greedy row: its processed logits, unscaled; the token is their argmax
    torch.testing.assert_close(drawn[2], logits[2])
    assert int(tokens[2]) == int(logits[2].argmax())

    # the processed distribution differs from the raw one wherever a transform applied
    raw = torch.log_softmax(logits, -1)
    processed = torch.log_softmax(drawn, -1)
    assert not torch.allclose(raw[0], processed[0]) and not torch.allclose(raw[1], processed[1])
    torch.testing.assert_close(raw[2], processed[2])


def test_greedy_batch_reports_masked_logits():
    logits = torch.arange(V, dtype=torch.float32).unsqueeze(0).repeat(2, 1)
    params = [SamplingParams(temperature=0, logit_bias={0: 100.0}), SamplingParams(temperature=0)]
    tokens, drawn = Sampler().sample_with_logits(logits, info_for(params))
    assert tokens.tolist() == [0, V - 1]
    assert float(drawn[0, 0]) == 100.0 and torch.equal(drawn[1], logits[1])


def _forward_input(processed: list[bool], batch: int):
    lp = LogprobRequest(
        return_logprob=torch.ones(batch, dtype=torch.bool),
        top_logprobs_nums=[0] * batch,
        token_ids_logprob=[None] * batch,
        processed=processed,
    )
    return types.SimpleNamespace(logprobs=lp, batch_size=batch)


def test_runner_replaces_only_processed_rows():
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    drawn = logits / 0.5
    drawn[1, :4] = float("-inf")  # tokens a filter dropped
    idx = torch.arange(2)
    plan = _LogitRows(rows=idx, last=idx, starts=[], first_new=[])
    logp = ModelRunner._log_softmax(logits, plan, _forward_input([False, True], 2), drawn)
    torch.testing.assert_close(logp[0], torch.log_softmax(logits[0], -1))
    expect = torch.log_softmax(drawn[1], -1)
    torch.testing.assert_close(logp[1, 4:], expect[4:])
    # excluded tokens read a finite floor (JSON has no -inf)
    assert torch.isfinite(logp).all() and (logp[1, :4] == torch.finfo(torch.float32).min).all()
    # no processed row: plain log_softmax
    plain = ModelRunner._log_softmax(logits, plan, _forward_input([], 2), None)
    torch.testing.assert_close(plain, torch.log_softmax(logits, -1))


def test_runner_reads_each_requests_last_row_with_input_logprob_rows():
    # request 0 asked for input logprobs (rows 0..2, last row 2); request 1 has only its last row 3
    torch.manual_seed(2)
    logits = torch.randn(4, V)
    drawn = torch.randn(2, V)
    plan = _LogitRows(rows=torch.arange(4), last=torch.tensor([2, 3]), starts=[0, -1], first_new=[0, 4])
    logp = ModelRunner._log_softmax(logits, plan, _forward_input([True, True], 2), drawn)
    torch.testing.assert_close(logp[:2], torch.log_softmax(logits[:2], -1))  # input rows stay raw
    torch.testing.assert_close(logp[2], torch.log_softmax(drawn[0], -1))
    torch.testing.assert_close(logp[3], torch.log_softmax(drawn[1], -1))
