"""The Engine's bfloat16 decode path on a GPU: decode graphs fed from the pinned staging ring, the
one-row layers with their norms folded into the projections, programmatic dependent launch (PDL)
and the Triton argmax.

The switches under test change how kernels are launched, never what they compute, so greedy ids
must be identical, token for token:

- batch 1 with and without CUDA graphs (eager decode runs the same kernels at the same size);
- batches of 1 and 6 with PDL on and off (the same graphs; a missing wait would read stale
  activations and change tokens);
- continuous decode (several steps per launch, replays of one graph, each step's tokens fed to
  the next on the device), at a fixed count and at the default (auto: as many steps as fit the
  budget at the measured step time), greedy and sampled.

``--gemm-library cublaslt`` may pick other kernels, so only its plumbing and output lengths are
checked.

The reference runs one step per launch (``num_continuous_decode_steps=1``).

Uses the default model when it is installed; with ``PHLOEM_TEST_TOKENIZER`` set (a tokenizer
folder), dummy weights of the default model's shape instead.
"""

from __future__ import annotations

import os

import pytest
import torch

from phloem import Engine
from tests.integration.test_engine_speculative import PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
BATCH = PROMPTS[:6]


def _ids(monkeypatch, pdl: bool, live: dict | None = None, **kw) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy ids of each prompt alone, then of the batch, from a fresh engine (one decode step
    per launch unless ``kw`` says otherwise; ``live`` receives the scheduler's counters)."""
    monkeypatch.setenv("PHLOEM_PDL", "1" if pdl else "0")  # read by the scheduler process
    tok = os.environ.get("PHLOEM_TEST_TOKENIZER")
    model = {"load_format": "dummy", "tokenizer_path": tok} if tok else {}
    kw.setdefault("num_continuous_decode_steps", 1)
    with Engine(device="cuda", dtype="bfloat16", log_level="warning", **model, **kw) as eng:
        alone = [eng.generate(p, sampling_params=GREEDY)["output_ids"] for p in BATCH[:3]]
        batch = [o["output_ids"] for o in eng.generate(BATCH, sampling_params=[dict(GREEDY) for _ in BATCH])]
        if live is not None:
            live.update(eng.get_server_info()["live"])
    return alone, batch


@pytest.fixture(scope="module")
def graphs_pdl():
    """The reference: ids alone, ids of the batch, and the scheduler's counters."""
    live: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        return (*_ids(mp, pdl=True, live=live), live)


def _admission(live: dict, ref: dict) -> str:
    """Says, for a failed comparison, whether the two engines prefilled in as many passes: a
    batch admitted in other groups than the reference's rounds differently (its near-ties on
    dummy weights then pick other tokens) without any launch setting being at fault."""
    return (
        f"prefill passes {live.get('prefill_batches_total')} against the reference's "
        f"{ref.get('prefill_batches_total')}; continuous steps {live.get('continuous_decode_steps_total')}"
    )


def test_pdl_changes_no_token(graphs_pdl, monkeypatch) -> None:
    alone, batch = _ids(monkeypatch, pdl=False)
    assert alone == graphs_pdl[0]
    assert batch == graphs_pdl[1]
    assert all(len(ids) == GREEDY["max_new_tokens"] for ids in alone + batch)


def test_batch_one_graphs_equal_eager_decode(graphs_pdl, monkeypatch) -> None:
    alone, _ = _ids(monkeypatch, pdl=True, disable_cuda_graph=True)
    assert alone == graphs_pdl[0]


def test_continuous_decode_changes_no_token(graphs_pdl, monkeypatch) -> None:
    """Eight decode steps per launch (graph replays fed on the device): the same ids alone and
    in the batch of six."""
    live: dict = {}
    alone, batch = _ids(monkeypatch, pdl=True, live=live, num_continuous_decode_steps=8)
    assert alone == graphs_pdl[0], _admission(live, graphs_pdl[2])
    assert batch == graphs_pdl[1], _admission(live, graphs_pdl[2])


def test_default_auto_continuous_decode_changes_no_token(graphs_pdl, monkeypatch) -> None:
    """The default (``num_continuous_decode_steps=0``, auto): on CUDA a decode step of the default
    model's shape takes well under the 8 ms budget, so launches carry several steps."""
    live: dict = {}
    alone, batch = _ids(monkeypatch, pdl=True, live=live, num_continuous_decode_steps=0)
    assert alone == graphs_pdl[0], _admission(live, graphs_pdl[2])
    assert batch == graphs_pdl[1], _admission(live, graphs_pdl[2])
    assert live["continuous_decode_steps_total"] > 0
    assert 0 < live["decode_step_ms"] < 8


def test_sampled_tokens_equal_with_replayed_steps(monkeypatch) -> None:
    """Unseeded sampled rows (temperature, top-k, top-p) in continuous decode, whose steps replay
    one graph back to back (``ModelRunner.forward_steps``): the sampler draws from its generator
    once a step, as with one step per launch, so one request gives the same tokens either way
    (the sampler restarts its generator after the start-up warm-up)."""
    monkeypatch.setenv("PHLOEM_PDL", "1")
    tok = os.environ.get("PHLOEM_TEST_TOKENIZER")
    model = {"load_format": "dummy", "tokenizer_path": tok} if tok else {}
    params = {"max_new_tokens": 40, "temperature": 0.8, "top_k": 50, "top_p": 0.95, "ignore_eos": True}
    ids, steps = [], []
    for k in (1, 8):
        with Engine(
            device="cuda", dtype="bfloat16", log_level="warning", num_continuous_decode_steps=k, **model
        ) as eng:
            ids.append(eng.generate(BATCH[0], sampling_params=dict(params))["output_ids"])
            steps.append(eng.get_server_info()["live"]["continuous_decode_steps_total"])
    assert ids[0] == ids[1] and len(ids[0]) == params["max_new_tokens"]
    assert steps[0] == 0 and steps[1] > 0


def test_gemm_library_reaches_the_model_runner(monkeypatch) -> None:
    """``auto`` leaves the default model (hidden size 576) on torch's own choice (what an untouched
    process reports; cuBLAS in torch 2.11); an explicit ``cublaslt`` is what the scheduler
    process's torch then uses, and decoding runs through it."""
    untouched = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1].lower()
    for choice, expected in (("auto", untouched), ("cublaslt", "cublaslt")):
        live: dict = {}
        tok = os.environ.get("PHLOEM_TEST_TOKENIZER")
        model = {"load_format": "dummy", "tokenizer_path": tok} if tok else {}
        with Engine(
            device="cuda", dtype="bfloat16", log_level="warning", gemm_library=choice, **model
        ) as eng:
            live.update(eng.get_server_info())
            outs = eng.generate(BATCH, sampling_params=[dict(GREEDY) for _ in BATCH])
        assert live["gemm_library"] == expected
        assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outs)


def _logprobs(monkeypatch, **kw) -> list[dict]:
    """Greedy outputs of four prompts with the sampled tokens' logprobs and the top three, and
    the same prompts followed by their outputs, scored as input (prefill logprobs)."""
    monkeypatch.setenv("PHLOEM_PDL", "1")
    tok = os.environ.get("PHLOEM_TEST_TOKENIZER")
    model = {"load_format": "dummy", "tokenizer_path": tok} if tok else {}
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    with Engine(device="cuda", dtype="bfloat16", log_level="warning", **model, **kw) as eng:
        prompts = [eng.tokenize(p) for p in BATCH[:4]]
        outs = eng.generate(
            input_ids=prompts, sampling_params=[dict(params) for _ in prompts], return_logprob=True,
            top_logprobs_num=3,
        )  # fmt: skip
        ids = [p + o["output_ids"] for p, o in zip(prompts, outs)]
        scored = eng.generate(
            input_ids=ids, sampling_params=[{"max_new_tokens": 0} for _ in ids], return_logprob=True,
            logprob_start_len=0,
        )  # fmt: skip
    for o, s in zip(outs, scored):
        o["scored"] = s["meta_info"]["input_token_logprobs"]
    return outs


def test_logprobs_through_the_overlap_loop(monkeypatch) -> None:
    """Logprobs come back from pinned memory after the step's event (``ForwardOutput.logprobs``),
    read while the next step runs: every step's values must belong to that step's token and
    agree with the same tokens scored by a prefill."""
    for o in _logprobs(monkeypatch):
        olp, tops = o["meta_info"]["output_token_logprobs"], o["meta_info"]["output_top_logprobs"]
        n = len(o["output_ids"])
        assert n == 16 and [t[1] for t in olp] == o["output_ids"]
        assert all(top[0][1] == tok and top[0][0] == lp for top, (lp, tok, _) in zip(tops, olp))
        assert all(a[0] >= b[0] for top in tops for a, b in zip(top, top[1:]))
        assert [tok for _, tok, _ in o["scored"][-n:]] == o["output_ids"]
        prefill = [lp for lp, _, _ in o["scored"][-n:]]
        # bfloat16 activations: a decode step and a prefill round differently (on the CPU, bf16:
        # mean differences 0.015-0.054, largest 0.18); a step's values given to another step's
        # token would be off by whole units
        diff = [abs(a[0] - b) for a, b in zip(olp, prefill)]
        assert max(diff) < 0.5 and sum(diff) / n < 0.1, diff
