"""Attention backends by name, imported lazily (docs/design.md §1: one registry per pluggable axis)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from phloem.runtime.attention.base import AttentionBackend

__all__ = ["ATTENTION_BACKENDS", "get_attention_backend_class", "resolve_attention_backend"]

# name -> "module:Class" under phloem.runtime.attention
ATTENTION_BACKENDS: dict[str, str] = {
    "torch_ref": "torch_ref:TorchRefBackend",
    "cpu": "cpu:CpuBackend",
    "triton": "triton:TritonBackend",
    "flashinfer": "flashinfer:FlashInferBackend",
}


def resolve_attention_backend(name: str, device: torch.device | str) -> str:
    """Turn ``auto`` into a concrete name: ``cpu`` on CPU, the first importable GPU one on CUDA."""
    if name != "auto":
        if name not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; known: {sorted(ATTENTION_BACKENDS)}")
        return name
    if torch.device(device).type != "cuda":
        return "cpu"
    for candidate in ("triton", "torch_ref"):
        try:
            get_attention_backend_class(candidate)
            return candidate
        except ImportError:
            continue
    return "torch_ref"


def get_attention_backend_class(name: str) -> type[AttentionBackend]:
    """Import and return the backend class registered under ``name``."""
    module_name, cls_name = ATTENTION_BACKENDS[name].split(":")
    module = importlib.import_module(f"phloem.runtime.attention.{module_name}")
    return getattr(module, cls_name)
