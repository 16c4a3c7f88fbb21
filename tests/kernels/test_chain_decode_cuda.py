"""Chain decode launches on CUDA (``PHLOEM_JUMP_CHAIN``), replayed from their graphs: an Engine
decoding under them gives valid records, token for token what the same Engine gives decoding one
forced token a step (device spelling)."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCHEMA = {
    "type": "object",
    "properties": {
        "customer_identification_code": {"type": "string", "maxLength": 8},
        "subscription_renewal_is_automatic": {"type": "boolean"},
        "preferred_contact_channel_for_updates": {"enum": ["email", "phone", "post"]},
    },
    "required": [
        "customer_identification_code",
        "subscription_renewal_is_automatic",
        "preferred_contact_channel_for_updates",
    ],
    "additionalProperties": False,
}


def _run(monkeypatch, env: dict[str, str], **kw):
    from phloem import Engine

    for name in ("PHLOEM_JUMP_CHAIN", "PHLOEM_JUMP_FORWARD_DEVICE_SPELLING"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # read by the scheduler process
    params = {"max_new_tokens": 200, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
    tok = os.environ.get("PHLOEM_TEST_TOKENIZER")  # dummy weights with a tokenizer, else the default model
    model = {"load_format": "dummy", "tokenizer_path": tok} if tok else {}
    prompts = ["A customer record:"] * 3 + ["Another one:"] * 5 + ["Customer data as JSON:"] * 4
    # float weights: quantized kernels round a several-row pass and a one-row step differently
    with Engine(
        device="cuda", dtype="float32", quantization="none", log_level="warning", **model, **kw
    ) as eng:
        outs = eng.generate(prompts, sampling_params=params)
        return outs, eng.get_server_info()["live"]


def test_chain_launches_on_cuda_decode_as_device_spelling_does(monkeypatch) -> None:
    import jsonschema

    chained, live = _run(monkeypatch, {"PHLOEM_JUMP_CHAIN": "8"}, enable_jump_forward=True)
    assert live["chain_launches_total"] > 0 and live["chain_forced_tokens_total"] > 50
    for o in chained:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        jsonschema.validate(json.loads(o["text"]), SCHEMA)
    plain, _ = _run(monkeypatch, {"PHLOEM_JUMP_FORWARD_DEVICE_SPELLING": "1"})
    assert [o["output_ids"] for o in chained] == [o["output_ids"] for o in plain]
