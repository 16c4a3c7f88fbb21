"""Early exit of continuous decode on a GPU (``executor/decode_exit.py``): once every row of a
launch sampled a stop token, the decode graphs skip the rest of the launch and the launch queued
after it. Greedy ids and finish reasons must equal those of the same engine without early exit
(``PHLOEM_DECODE_EARLY_EXIT=0``), token for token, and the skipped steps are counted.

Uses the default model when it is installed; with ``PHLOEM_TEST_TOKENIZER`` set (a tokenizer
folder), dummy weights of the default model's shape instead (stops are then set on tokens the
model is seen to produce, so they happen either way).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from phloem import Engine
from tests.integration.test_engine_grammar_on_device import BOUNDED
from tests.integration.test_engine_speculative import PROMPTS


def _conditional_graphs() -> bool:
    from phloem.runtime.executor.decode_exit import conditional_graphs_supported

    return conditional_graphs_supported()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        torch.cuda.is_available() and not _conditional_graphs(),
        reason="early exit needs a torch that captures CUDA graph conditional nodes",
    ),
]

FREE = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


def _stop_index(ids: list[int], k: int) -> int:
    """Where a stop on token ``ids[k]`` ends the output: its first occurrence."""
    return ids.index(ids[k])


def _run(monkeypatch, early_exit: bool) -> tuple[list, list, dict]:
    monkeypatch.setenv("PHLOEM_DECODE_EARLY_EXIT", "1" if early_exit else "0")  # read at start-up
    tok = os.environ.get("PHLOEM_TEST_TOKENIZER")
    model = {"load_format": "dummy", "tokenizer_path": tok} if tok else {}
    with Engine(
        device="cuda", dtype="bfloat16", log_level="warning", num_continuous_decode_steps=8, **model
    ) as eng:
        free = [eng.generate(p, sampling_params=FREE)["output_ids"] for p in PROMPTS[:3]]
        cut = [_stop_index(ids, k) for ids, k in zip(free, (4, 13, 22))]
        stopped = [
            eng.generate(p, sampling_params={**FREE, "stop_token_ids": [ids[k]]})
            for p, ids, k in zip(PROMPTS[:3], free, cut)
        ]
        batch = eng.generate(
            PROMPTS[:3], sampling_params=[{**FREE, "stop_token_ids": [ids[k]]} for ids, k in zip(free, cut)]
        )
        grammar = eng.generate(
            "A number as JSON:",
            sampling_params={"temperature": 0, "max_new_tokens": 32, "json_schema": json.dumps(BOUNDED)},
        )
        live = eng.get_server_info()["live"]
    outs = [(o["output_ids"], o["meta_info"]["finish_reason"]) for o in [*stopped, *batch, grammar]]
    return free, outs, live


def test_early_exit_keeps_every_token_and_skips_steps(monkeypatch) -> None:
    free, outs, live = _run(monkeypatch, early_exit=True)
    free_off, outs_off, live_off = _run(monkeypatch, early_exit=False)
    assert free == free_off
    assert outs == outs_off
    for (ids, reason), full in zip(outs[:3], free):
        assert reason["type"] == "stop" and ids == full[: len(ids)]
    assert live["decode_steps_skipped_total"] > 0
    assert live_off["decode_steps_skipped_total"] == 0
