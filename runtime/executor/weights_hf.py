"""Hugging Face safetensors directories (Llama, Qwen2, Qwen3)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from phloem.runtime.models.config import ModelConfig

__all__ = ["hf_model_config", "iter_hf_weights"]


def hf_model_config(folder: str) -> ModelConfig:
    """:class:`ModelConfig` from ``folder/config.json``."""
    with open(os.path.join(folder, "config.json")) as f:
        return ModelConfig.from_hf_config(json.load(f))


def iter_hf_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every ``*.safetensors`` file in ``folder``.

    Tensors are memory-mapped and yielded one at a time, so peak memory stays near one tensor.
    """
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
