"""Logprobs an RL trainer can use, on the real default model (CPU).

A sampled rollout (temperature 0.7, top-p 0.9, seeded) asks for its output logprobs through
``Engine`` and over HTTP. In ``raw`` mode each sampled token's logprob must equal the one a float32
plain-torch forward of the same weights (transformers loading the same GGUF) gives that token
after the same context: what a trainer recomputes. In ``processed`` mode the same seeded rollout
reports the distribution the token was drawn from: the reference logits divided by the
temperature, restricted to the top-p nucleus and renormalized.
"""

from __future__ import annotations

import os

import pytest
import requests
import torch
from phloem.runtime.model_files import resolve_model

pytestmark = pytest.mark.slow

PROMPT = "Write a short poem about the sea and the wind."
TEMPERATURE, TOP_P = 0.7, 0.9
PARAMS = {"max_new_tokens": 24, "temperature": TEMPERATURE, "top_p": TOP_P, "sampling_seed": 2024}
TOL = 1e-4


@pytest.fixture(scope="module")
def engine(float_engine):
    """Exact float32 weights: these logprobs are checked against a float32 forward."""
    return float_engine


@pytest.fixture(scope="module")
def server(float_server):
    """Exact float32 weights: these logprobs are checked against a float32 forward."""
    return float_server


@pytest.fixture(scope="module")
def reference():
    """``ids -> [len(ids), V]`` float32 logits of transformers' forward over the default GGUF."""
    from transformers import AutoModelForCausalLM

    path = resolve_model(None).path
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float()

    return logits


def _rollout(out: dict) -> tuple[list[int], list[float]]:
    triples = out["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"]
    return out["output_ids"], [t[0] for t in triples]


def _reference_logits(reference, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """Row ``j``: the reference logits that predicted output token ``j``."""
    full = reference(prompt_ids + output_ids)
    return full[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(output_ids)]


def _raw(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]


def _processed(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Logprob of each token under temperature then top-p, as the sampler defines them."""
    x = logits / TEMPERATURE
    probs = torch.softmax(x, -1)
    sorted_p, order = probs.sort(-1, descending=True)
    drop_sorted = (sorted_p.cumsum(-1) - sorted_p) > TOP_P
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return torch.log_softmax(x.masked_fill(drop, float("-inf")), -1).gather(1, torch.tensor(ids)[:, None])[:, 0]


def _prompt_ids(engine) -> list[int]:
    # the prompt's ids as the engine tokenized them: a prefill-only request echoes them back
    out = engine.generate(PROMPT, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    return [t[1] for t in out["meta_info"]["input_token_logprobs"]]


def test_engine_raw_logprobs_match_a_float32_torch_forward(engine, reference):
    prompt_ids = _prompt_ids(engine)
    out = engine.generate(PROMPT, sampling_params={**PARAMS, "logprob_mode": "raw"}, return_logprob=True)
    ids, got = _rollout(out)
    assert len(ids) > 4
    logits = _reference_logits(reference, prompt_ids, ids)
    expect = _raw(logits, ids)
    assert (torch.tensor(got) - expect).abs().max().item() < TOL
    # the default is raw: leaving the field out gives the same values
    default = engine.generate(PROMPT, sampling_params=PARAMS, return_logprob=True)
    assert _rollout(default) == (ids, got)

    # processed: the same seeded tokens, their logprobs under temperature and top-p
    processed = engine.generate(
        PROMPT, sampling_params={**PARAMS, "logprob_mode": "processed"}, return_logprob=True
    )
    p_ids, p_got = _rollout(processed)
    assert p_ids == ids
    assert (torch.tensor(p_got) - _processed(logits, ids)).abs().max().item() < TOL
    assert (torch.tensor(p_got) - expect).abs().max().item() > 1e-2  # the modes really differ


def test_http_raw_and_processed_logprobs(server, engine, reference):
    prompt_ids = _prompt_ids(engine)
    results = {}
    for mode in ("raw", "processed"):
        body = {
            "text": PROMPT,
            "sampling_params": {**PARAMS, "logprob_mode": mode},
            "return_logprob": True,
            "top_logprobs_num": 3,
        }
        r = requests.post(server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        results[mode] = r.json()
    ids, raw = _rollout(results["raw"])
    p_ids, processed = _rollout(results["processed"])
    assert p_ids == ids
    logits = _reference_logits(reference, prompt_ids, ids)
    assert (torch.tensor(raw) - _raw(logits, ids)).abs().max().item() < TOL
    assert (torch.tensor(processed) - _processed(logits, ids)).abs().max().item() < TOL
    # top alternatives come from the same distribution as the token's own logprob
    for mode, values in (("raw", raw), ("processed", processed)):
        tops = results[mode]["meta_info"]["output_top_logprobs"]
        for value, token, alternatives in zip(values, ids, tops):
            for lp, tid, _ in alternatives:
                if tid == token:
                    assert lp == pytest.approx(value, abs=1e-6)

    bad = requests.post(
        server.url + "/generate",
        json={"text": PROMPT, "sampling_params": {"logprob_mode": "scaled"}, "return_logprob": True},
        timeout=30,
    )
    assert bad.status_code == 400 and "sampling_params.logprob_mode" in bad.text


def test_processed_logprobs_see_logit_bias(engine):
    # a bias of 100 makes one token certain: processed says so, raw still reports the model's view
    token = engine.tm.tokenizer.encode(" blue")[0]
    params = {"max_new_tokens": 3, "temperature": 0.7, "sampling_seed": 1, "logit_bias": {str(token): 100.0}}
    raw = engine.generate(PROMPT, sampling_params=params, return_logprob=True)
    processed = engine.generate(PROMPT, sampling_params={**params, "logprob_mode": "processed"}, return_logprob=True)
    assert raw["output_ids"] == processed["output_ids"] == [token] * 3
    assert all(lp > -1e-4 for lp, _, _ in processed["meta_info"]["output_token_logprobs"])
    assert all(lp < -1.0 for lp, _, _ in raw["meta_info"]["output_token_logprobs"])
