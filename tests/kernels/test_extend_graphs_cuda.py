"""Short extends replayed from CUDA graphs (``executor/extend_graphs.py``) give the eager extend's
logits and K/V, for batches padded to a captured size; jump-forward on the CUDA Engine keeps every
output valid."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def runner():
    from phloem.runtime.executor.model_runner import ModelRunner
    from phloem.runtime.model_files import resolve_model

    return ModelRunner(
        resolve_model("smollm2-135m", "dummy"),
        dtype="bfloat16", device="cuda", attention_backend="triton",
        max_total_tokens=8192, max_running_requests=16, context_len=1024, extend_graph_tokens=16,
    )  # fmt: skip


def test_short_extend_replays_match_eager(runner) -> None:
    from phloem.runtime.executor.model_runner import DirectBatcher

    assert runner.extend_graphs is not None and set(runner.extend_graphs.verify.graphs) == {1, 2, 4, 8, 16}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist() for n in (3, 40, 130)]
    new = [torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist() for n in (16, 1, 9)]
    b = DirectBatcher(runner)  # one batcher: its slots never repeat, so each copy has its own KV
    es, gs = ([b.new_sequence() for _ in prompts] for _ in range(2))
    b.logits(dict(zip(es + gs, prompts + prompts)))  # 130 tokens: wider than the graphs, eager
    eager_b = graph_b = b
    graphs, runner.extend_graphs = runner.extend_graphs, None
    try:
        want = eager_b.logits(dict(zip(es, new)))
    finally:
        runner.extend_graphs = graphs
    fi = graph_b.build(dict(zip(gs, new)))
    assert graphs.can_run(fi, wants_rows=False)
    got = runner.forward_logits(fi)  # 3 requests replayed padded to 4
    assert _rel(got, want) < 2e-2
    nxt = want.argmax(-1).tolist()
    after_graph = graph_b.logits({s: [t] for s, t in zip(gs, nxt)}, decode=True)
    after_eager = eager_b.logits({s: [t] for s, t in zip(es, nxt)}, decode=True)
    assert _rel(after_graph, after_eager) < 2e-2  # the K/V the graph wrote reads back the same


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_jump_forward_on_cuda_gives_valid_json(monkeypatch) -> None:
    """Host jumps (chain launches off: on CUDA they take forced text on the device instead)."""
    import jsonschema

    monkeypatch.setenv("PHLOEM_JUMP_CHAIN", "0")  # read by the scheduler process
    from phloem import Engine

    schema = {
        "type": "object",
        "properties": {
            "customer_identification_code": {"type": "string", "maxLength": 8},
            "subscription_renewal_is_automatic": {"type": "boolean"},
            "preferred_contact_channel": {"enum": ["email", "phone", "post"]},
        },
        "required": [
            "customer_identification_code",
            "subscription_renewal_is_automatic",
            "preferred_contact_channel",
        ],
        "additionalProperties": False,
    }
    params = {"max_new_tokens": 256, "temperature": 0, "json_schema": json.dumps(schema)}
    tok = os.environ.get("PHLOEM_TEST_TOKENIZER")  # dummy weights with a tokenizer, else the default model
    model = {"load_format": "dummy", "tokenizer_path": tok} if tok else {}
    with Engine(
        device="cuda", dtype="bfloat16", enable_jump_forward=True, log_level="warning", **model
    ) as eng:
        outs = eng.generate(["A customer record:"] * 3 + ["Another one:"] * 5, sampling_params=params)
        assert eng.get_server_info()["live"]["jump_forward_tokens_total"] > 20
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        jsonschema.validate(json.loads(o["text"]), schema)
