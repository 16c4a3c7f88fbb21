"""Draft-head training: the ``--tiny`` smoke run end to end on a random tiny target, the data
alignment, and the shipped head's metadata."""

from __future__ import annotations

import json
import os

import pytest
import torch
from phloem.runtime.speculative import DEFAULT_EAGLE_HEAD
from phloem.runtime.speculative.eagle import load_eagle_head
from phloem.runtime.speculative.train import (
    DEFAULT_PROMPTS,
    choose_draft_vocab,
    read_prompts,
    train_eagle_main,
)


def test_tiny_training_run(tmp_path):
    torch.set_num_threads(1)
    out = str(tmp_path / "head.safetensors")
    rc = train_eagle_main(["--target", "tiny-llama", "--load-format", "dummy", "--out", out, "--tiny"])
    assert rc == 0 and os.path.getsize(out) > 0
    head = load_eagle_head(out)
    assert head.cfg.hidden_size == 64 and head.token_map.numel() == head.cfg.draft_vocab_size
    from safetensors import safe_open

    with safe_open(out, framework="pt") as f:
        info = json.loads(f.metadata()["info"])
    assert set(info["heldout_accept_length"]) == {"chain", "tree"}
    assert all(v >= 1.0 for v in info["heldout_accept_length"].values())


def test_draft_vocab_prefers_frequent_labels_then_low_ids():
    labels = [torch.tensor([9, 9, 9, 7, 7, 5])]
    assert choose_draft_vocab(labels, 10, 4).tolist() == [0, 5, 7, 9]
    assert choose_draft_vocab(labels, 10, 20).tolist() == list(range(10))


def test_prompt_file_is_varied():
    prompts = read_prompts(DEFAULT_PROMPTS)
    assert len(prompts) >= 200 and len(set(prompts)) == len(prompts)


def test_mixed_prompts_are_distinct_seeded_and_avoid_the_heldout_set():
    from phloem.runtime.speculative.prompt_mix import mixed_prompts

    a = mixed_prompts(2000, seed=0)
    assert len(a) == len(set(a)) == 2000
    assert mixed_prompts(2000, seed=0) == a and mixed_prompts(2000, seed=1) != a
    assert not set(a) & set(read_prompts(DEFAULT_PROMPTS)[:12])


def test_cli_tiny_training_run_with_mixed_prompts(tmp_path):
    torch.set_num_threads(1)
    out = str(tmp_path / "head.safetensors")
    from phloem.cli import main

    argv = ["--target", "tiny-llama", "--load-format", "dummy", "--out", out, "--tiny", "--mixed-prompts", "6"]
    assert main(["train-eagle", *argv]) == 0  # through the command line, flags first
    from safetensors import safe_open

    with safe_open(out, framework="pt") as f:
        info = json.loads(f.metadata()["info"])
    assert info["train_sequences"] == 8 + 6  # --tiny keeps 8 hand-written prompts; the mix adds 6


@pytest.mark.skipif(not os.path.exists(DEFAULT_EAGLE_HEAD), reason="shipped head missing")
def test_shipped_head_fits_the_default_model_shape():
    assert os.path.getsize(DEFAULT_EAGLE_HEAD) < 10 * 2**20
    head = load_eagle_head(DEFAULT_EAGLE_HEAD)
    c = head.cfg
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (576, 9, 3, 64, 49152)
    assert head.token_map.min() >= 0 and head.token_map.max() < c.vocab_size
