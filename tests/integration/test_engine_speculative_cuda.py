"""The Engine on a GPU. Speculative decoding: the verify pass runs padded, through the Triton
tree attention and from CUDA graphs (batch sizes 1..32), and greedy outputs equal plain decoding's
token for token in float32 (bf16 verify passes and decode steps may round differently). The
overlap loop gives the inline loop's ids.

Uses the default model when it is installed; with ``PHLOEM_TEST_TOKENIZER`` set (a tokenizer
folder), dummy weights of the default model's shape instead (machines without the model file).
"""

from __future__ import annotations

import os

import pytest
import torch

from phloem import Engine
from tests.integration.test_engine_speculative import PARAMS, PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _engine(**kw) -> Engine:
    tok = os.environ.get("PHLOEM_TEST_TOKENIZER")
    model = {"load_format": "dummy", "tokenizer_path": tok} if tok else {}
    return Engine(device="cuda", dtype="float32", log_level="warning", **model, **kw)


@pytest.fixture(scope="module")
def reference():
    with _engine(disable_overlap_schedule=True) as eng:
        return eng.generate(PROMPTS, sampling_params=PARAMS)


@pytest.mark.parametrize("algo", ["EAGLE", "NGRAM"])
def test_speculative_greedy_equals_plain_greedy_on_gpu(reference, algo):
    with _engine(speculative_algorithm=algo, speculative_num_steps=3, speculative_eagle_topk=2,
                 speculative_num_draft_tokens=6) as eng:  # fmt: skip
        for batch in (PROMPTS[:1], PROMPTS[:5], PROMPTS):  # graphs of sizes 1, 8 and 16
            outs = eng.generate(batch, sampling_params=PARAMS[: len(batch)])
            for got, want in zip(outs, reference):
                assert got["output_ids"] == want["output_ids"]
            assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs) > 0


def test_overlap_loop_equals_the_inline_loop_on_gpu(reference):
    """The overlap loop (futures for in-flight tokens, pinned copies, decode graphs) gives the
    inline loop's greedy ids, with stop strings and JSON-schema constraints in the batch."""
    with _engine() as eng:
        for batch in (PROMPTS[:1], PROMPTS):
            outs = eng.generate(batch, sampling_params=PARAMS[: len(batch)])
            assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in reference[: len(batch)]]


def test_speculative_windows_equal_plain_greedy_on_gpu(reference):
    """Windows of greedy EAGLE chain steps replayed from CUDA graphs (batches padded to 1, 8 and
    16) give plain greedy ids, stop strings and constrained rows (single steps) included; sampled
    rows take windows too."""
    with _engine(speculative_algorithm="EAGLE", num_continuous_decode_steps=6) as eng:
        for batch in (PROMPTS[:1], PROMPTS[:5], PROMPTS):
            outs = eng.generate(batch, sampling_params=PARAMS[: len(batch)])
            for got, want in zip(outs, reference):
                assert got["output_ids"] == want["output_ids"]
        assert eng.get_server_info()["live"]["spec_window_steps_total"] > 0
        # sampled rows: device draws inside the captured step (the graph advances the generator)
        before = eng.get_server_info()["live"]["spec_window_steps_total"]
        sampled = eng.generate(
            PROMPTS[:5], sampling_params={"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 24}
        )
        assert eng.get_server_info()["live"]["spec_window_steps_total"] > before
        assert all(1 <= o["meta_info"]["completion_tokens"] <= 24 for o in sampled)
        assert len({tuple(o["output_ids"]) for o in sampled}) > 1
