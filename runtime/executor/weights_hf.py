"""Hugging Face safetensors directories (Llama, Qwen2, Qwen3)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from phloem.runtime.distributed.slices import LazySlice
from phloem.runtime.models.config import ModelConfig

__all__ = ["hf_model_config", "iter_hf_slices", "iter_hf_weights"]


def hf_model_config(folder: str) -> ModelConfig:
    """:class:`ModelConfig` from ``folder/config.json``."""
    with open(os.path.join(folder, "config.json")) as f:
        return ModelConfig.from_hf_config(json.load(f))


def iter_hf_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every ``*.safetensors`` file in ``folder``.

    Tensors are memory-mapped and yielded one at a time, so peak memory stays near one tensor.
    """
    from safetensors import safe_open

    for path in _files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def iter_hf_slices(folder: str) -> Iterator[tuple[str, LazySlice]]:
    """Yield ``(name, lazy slice)`` for every tensor in ``folder``: nothing is read until the slice
    is indexed, and then only the indexed rows or columns (a tensor-parallel rank's share)."""
    from safetensors import safe_open

    for path in _files(folder):
        with safe_open(path, framework="pt") as f:  # a slice keeps its file mapped after close
            for name in f.keys():
                yield name, f.get_slice(name)


def _files(folder: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return files
