"""Jump-forward on the default model: forced JSON keys are appended without a forward pass per
token, outputs stay valid, and streaming agrees with the non-streamed result."""

from __future__ import annotations

import json

import jsonschema
import pytest

from phloem import Engine

SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 16},
        "customer_is_premium_member": {"type": "boolean"},
        "customer_favourite_colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["customer_full_name", "customer_is_premium_member", "customer_favourite_colour"],
    "additionalProperties": False,
}


# keys long enough that the model, left to itself, spells some in more tokens than the tokenizer
LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_identification_code": {"type": "string", "maxLength": 6},
        "preferred_delivery_address_line": {"type": "string", "maxLength": 12},
        "subscription_renewal_is_automatic": {"type": "boolean"},
        "preferred_contact_channel_for_updates": {"enum": ["email", "phone", "post"]},
    },
    "required": [
        "customer_identification_code",
        "preferred_delivery_address_line",
        "subscription_renewal_is_automatic",
        "preferred_contact_channel_for_updates",
    ],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def jf_engine():
    with Engine(enable_jump_forward=True, log_level="warning") as eng:
        yield eng


def test_jump_forward_outputs_validate_and_skip_forward_passes(jf_engine):
    params = {"max_new_tokens": 96, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
    prompts = ["Customer record as JSON:", "A premium customer:", "Describe a customer:"]
    outs = jf_engine.generate(prompts, sampling_params=params)
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        jsonschema.validate(json.loads(o["text"]), SCHEMA)
    assert jf_engine.get_server_info()["live"]["jump_forward_tokens_total"] > 20
    # the forced key tokens are canonical: the output ids are exactly the tokenization of the text
    tok = jf_engine.tm.tokenizer
    for o in outs:
        assert tok.decode(o["output_ids"]).startswith(o["text"])


def test_jump_forward_streaming_matches_non_streaming(jf_engine):
    params = {"max_new_tokens": 96, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
    full = jf_engine.generate("Customer record as JSON:", sampling_params=params)
    chunks = list(jf_engine.generate("Customer record as JSON:", sampling_params=params, stream=True))
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


CUSTOMER_PROMPTS = ["Customer record as JSON:", "A premium customer:", "Describe a customer:"]


def _continuous_run(schema=SCHEMA, prompts=CUSTOMER_PROMPTS, *, max_new=96, steps=4, **kw):
    """Greedy outputs of ``prompts`` under ``schema`` from an Engine whose grammars run on the
    device in continuous launches of ``steps``, with its server info and tokenizer."""
    params = {"max_new_tokens": max_new, "temperature": 0, "json_schema": json.dumps(schema)}
    kw = {"enable_jump_forward": True, **kw}
    with Engine(grammar_on_device="on", num_continuous_decode_steps=steps, log_level="warning", **kw) as eng:
        outs = eng.generate(prompts, sampling_params=params)
        return outs, eng.get_server_info(), eng.tm.tokenizer


def test_jump_forward_after_continuous_launches(monkeypatch):
    """Rows masked on the device decode several steps a launch; a launch that ends inside a forced
    run jumps the rest of it. Outputs stay valid and the text is the canonical tokenization. Under
    the overlap loop a jumping row's next launch is already in flight: its tokens are thrown away
    and the outputs are the inline loop's, token for token (``PHLOEM_JUMP_FORWARD_OVERLAP``)."""
    outs, info, tok = _continuous_run()
    monkeypatch.setenv("PHLOEM_JUMP_FORWARD_OVERLAP", "1")  # read by the scheduler process
    overlapped, info_overlap, _ = _continuous_run(enable_cpu_overlap_schedule=True)
    assert info_overlap["overlap_schedule"] is True and info["overlap_schedule"] is False
    for live in (info["live"], info_overlap["live"]):
        assert live["continuous_decode_steps_total"] > 0 and live["jump_forward_tokens_total"] > 20
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        jsonschema.validate(json.loads(o["text"]), SCHEMA)
        assert tok.decode(o["output_ids"]).startswith(o["text"])
    assert info["live"]["jump_forward_stale_tokens_total"] == 0
    assert info_overlap["live"]["jump_forward_stale_tokens_total"] > 0  # launches were thrown away
    assert [o["output_ids"] for o in overlapped] == [o["output_ids"] for o in outs]


def test_forced_text_spelled_on_the_device(monkeypatch):
    """``PHLOEM_JUMP_FORWARD_DEVICE_SPELLING``: inside a continuous launch, a row in a state that
    forces text takes the first token of the tokenizer's encoding of it, so forced keys come out
    in the tokenizer's spelling without a jump. Outputs stay valid and take no more tokens."""
    prompts = ["Write a customer record as JSON:", "A customer who prefers email:"]
    plain, _, tok = _continuous_run(LONG_KEYS, prompts, max_new=160, steps=8)
    monkeypatch.setenv("PHLOEM_JUMP_FORWARD_DEVICE_SPELLING", "1")  # read by the scheduler process
    spelled, info, _ = _continuous_run(LONG_KEYS, prompts, max_new=160, steps=8)
    assert info["live"]["continuous_decode_steps_total"] > 0
    for o, p in zip(spelled, plain):
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        jsonschema.validate(json.loads(o["text"]), LONG_KEYS)
        assert tok.decode(o["output_ids"]).startswith(o["text"])
        assert len(o["output_ids"]) <= len(p["output_ids"])
    assert sum(map(len, (o["output_ids"] for o in spelled))) < sum(map(len, (p["output_ids"] for p in plain)))


def test_chain_launches_decode_as_device_spelling_does(monkeypatch):
    """``PHLOEM_JUMP_CHAIN``: every step of a continuous launch also takes each row's forced
    tokens, on the device. A forced state allows one token, so the output is token for token what
    decoding each of them in a step of its own gives (device spelling without jump-forward), here
    under the overlap loop, where each chain launch starts behind the one in flight; every output
    is valid and its ids are the tokenization of its text. The free row of the batch decodes one
    node a step: token for token the plain engine's. A chain step may take more tokens than a row
    has left: cut by ``max_new_tokens``, a row ends with exactly that many, the start of its text.
    Float weights on both sides: the GGUF's integer-dot kernels quantize activations, so a pass of
    several rows a request and a one-row step round differently and near ties may part."""
    prompts = ["Write a customer record as JSON:", "Once upon", "A customer who prefers email:", "Customers:"]
    schema = json.dumps(LONG_KEYS)
    params = [
        {"max_new_tokens": 160, "temperature": 0, **({} if i == 1 else {"json_schema": schema})}
        for i in range(len(prompts))
    ]
    budgets = (1, 2, 5, 9, 14)

    def run(**kw):
        with Engine(grammar_on_device="on", num_continuous_decode_steps=8, quantization="none",
                    log_level="warning", **kw) as eng:  # fmt: skip
            outs = eng.generate(prompts, sampling_params=params)
            cut = [
                eng.generate(prompts[0], sampling_params={**params[0], "max_new_tokens": n}) for n in budgets
            ]
            return outs, cut, eng.get_server_info(), eng.tm.tokenizer

    monkeypatch.setenv("PHLOEM_JUMP_FORWARD_DEVICE_SPELLING", "1")  # read by the scheduler process
    plain, _, _, tok = run()
    monkeypatch.delenv("PHLOEM_JUMP_FORWARD_DEVICE_SPELLING")
    monkeypatch.setenv("PHLOEM_JUMP_CHAIN", "6")
    chained, cut, info, _ = run(enable_jump_forward=True, enable_cpu_overlap_schedule=True)
    live = info["live"]
    assert info["overlap_schedule"] is True
    assert live["chain_launches_total"] > 0 and live["chain_forced_tokens_total"] > 30
    assert live["jump_forward_tokens_total"] == 0  # no row jumped on the host
    for i, o in enumerate(chained):
        if i != 1:
            assert o["meta_info"]["finish_reason"]["type"] == "stop", o
            jsonschema.validate(json.loads(o["text"]), LONG_KEYS)
            assert tok.decode(o["output_ids"]).startswith(o["text"])
    assert [o["output_ids"] for o in chained] == [o["output_ids"] for o in plain]
    for n, out in zip(budgets, cut):
        assert out["meta_info"]["finish_reason"]["type"] == "length", out
        assert out["output_ids"] == chained[0]["output_ids"][:n]


def test_jump_forward_cut_by_max_new_tokens(jf_engine):
    """A forced run longer than what is left of ``max_new_tokens`` never takes the output past it
    nor shortens it: exactly ``max_new_tokens`` tokens, spelling the start of the forced text."""
    forced = '{"customer_full_name": "'
    tok = jf_engine.tm.tokenizer
    for budget in (1, 3, len(tok.encode(forced, add_special_tokens=False)) - 1):
        params = {"max_new_tokens": budget, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
        out = jf_engine.generate("Customer record as JSON:", sampling_params=params)
        assert out["meta_info"]["finish_reason"]["type"] == "length", out
        assert len(out["output_ids"]) == budget
        assert forced.startswith(tok.decode(out["output_ids"])) and out["text"]


def test_jump_lead_extends_forced_keys_inside_the_decode_launch(monkeypatch):
    """``PHLOEM_JUMP_LEAD``: a jump's forced tokens are the first pass of the next continuous
    decode launch (the other rows decode a token in it) instead of an extend pass of their own.
    Outputs stay valid, the text is the canonical tokenization, and the launches were taken."""
    prompts = ["Write a customer record as JSON:", "A customer who prefers email:", "Customer data:"]
    monkeypatch.setenv("PHLOEM_JUMP_LEAD", "1")  # read by the scheduler process
    outs, info, tok = _continuous_run(LONG_KEYS, prompts, max_new=160, steps=4)
    live = info["live"]
    assert live["jump_lead_launches_total"] > 0 and live["jump_forward_tokens_total"] > 20
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        jsonschema.validate(json.loads(o["text"]), LONG_KEYS)
        assert tok.decode(o["output_ids"]).startswith(o["text"])
