"""Grammars on a GPU: a batch mixing JSON-schema, regex and free rows on the CUDA path (device
automata, the fused greedy step, continuous decode, CUDA graphs, the overlap loop) never emits a
token its grammar rejects, and at temperature 0 gives the tokens of the reference path (host
masks over the same DFA, one step per launch). Also a schema that stays on the host (xgrammar)
in the same engine.

Token equality needs the same batch at every step in both runs (bfloat16 logits depend on the
batch size), so it is checked one step per launch, every row admitted at once; continuous decode
is checked for validity here and for equal tokens on the CPU (``test_engine_grammar_on_device``).

Uses the default model when it is installed; with ``PHLOEM_TEST_TOKENIZER`` set (a tokenizer
folder), dummy weights of the default model's shape instead (outputs then often run to the
length limit: only rows that stop are parsed, and every row must not be aborted).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from phloem import Engine
from tests.integration.test_engine_grammar_on_device import BOUNDED, PARAMS, PROMPTS, _check_valid

# long rows: 200 letters, a string of 120, or no grammar and no EOS
FIXED = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
LONG = [
    {**FIXED, "regex": "[a-z ]{200}"},
    {**FIXED, "json_schema": json.dumps({"type": "object", "properties": {"note": {"type": "string", "pattern": "^[a-z ]{120}$"}}, "required": ["note"]})},
    FIXED,
]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _engine(**kw):
    tok = os.environ.get("PHLOEM_TEST_TOKENIZER")
    model = {"load_format": "dummy", "tokenizer_path": tok} if tok else {}
    return Engine(device="cuda", dtype="bfloat16", log_level="warning", **model, **kw)


def _fixed_run(**kw) -> list[dict]:
    """The equality batch twice (the first compiles its grammars, so the second admits every row
    at once), one step per launch; the second run's outputs."""
    batch = PROMPTS * 4
    fixed = [LONG[i % 3] for i in range(len(batch))]
    with _engine(num_continuous_decode_steps=1, **kw) as eng:
        eng.generate(batch, sampling_params=fixed)
        return eng.generate(batch, sampling_params=fixed)


@pytest.fixture(scope="module")
def runs():
    batch = PROMPTS * 4  # 24 rows: a graph batch size with padding
    params = PARAMS * 4
    with _engine(num_continuous_decode_steps=4) as eng:
        device = eng.generate(batch, sampling_params=params)
        steps = eng.get_server_info()["live"]["continuous_decode_steps_total"]
        bounded = eng.generate(
            "A number as JSON:",
            sampling_params={"temperature": 0, "max_new_tokens": 32, "json_schema": json.dumps(BOUNDED)},
        )
    device_fixed = _fixed_run()
    host_fixed = _fixed_run(grammar_backend="outlines", grammar_on_device="off")
    fixed = [LONG[i % 3] for i in range(len(batch))]
    return params, device, steps, bounded, (fixed, device_fixed, host_fixed)


def _valid_or_cut(out: dict, params: dict) -> None:
    kind = out["meta_info"]["finish_reason"]["type"]
    assert kind in ("stop", "length"), out["meta_info"]["finish_reason"]
    if kind == "stop" and ("json_schema" in params or "regex" in params):
        _check_valid(out, params)


def test_every_row_is_valid(runs):
    params, device, _, bounded, (fixed, device_fixed, host_fixed) = runs
    for outs, ps in ((device, params), (device_fixed, fixed), (host_fixed, fixed)):
        for out, p in zip(outs, ps):
            _valid_or_cut(out, p)
    _valid_or_cut(bounded, {"json_schema": json.dumps(BOUNDED)})


def test_greedy_tokens_equal_the_reference_path(runs):
    *_, (_, device_fixed, host_fixed) = runs
    for d, h in zip(device_fixed, host_fixed):
        assert d["output_ids"] == h["output_ids"]


def test_constrained_rows_decoded_ahead(runs):
    _, _, steps, *_ = runs
    assert steps > 0
