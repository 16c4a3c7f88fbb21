"""Model classes by architecture name, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

__all__ = ["MODEL_CLASSES", "get_model_class"]

# arch -> "module:Class" under phloem.runtime.models
MODEL_CLASSES: dict[str, str] = {
    "llama": "llama:LlamaForCausalLM",
    "qwen2": "llama:LlamaForCausalLM",  # attention bias via ModelConfig.attention_bias
    "qwen3": "llama:LlamaForCausalLM",  # q/k RMSNorm via ModelConfig.qk_norm
}


def get_model_class(arch: str) -> type[nn.Module]:
    """The ``nn.Module`` class implementing ``arch`` (a :class:`ModelConfig` ``arch`` value)."""
    if arch not in MODEL_CLASSES:
        raise ValueError(f"unsupported architecture {arch!r}; known: {sorted(MODEL_CLASSES)}")
    module_name, cls_name = MODEL_CLASSES[arch].split(":")
    module = importlib.import_module(f"phloem.runtime.models.{module_name}")
    return getattr(module, cls_name)
