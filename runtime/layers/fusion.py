"""Whether CUDA layers use the fused Triton kernels of :mod:`phloem.runtime.layers.fused_triton`.

On CUDA, RMSNorm (with its residual add), SiLU x mul and RoPE each run one fused kernel; on the
CPU, and on CUDA with the kernels switched off, they run their torch reference (the oracle the
kernels are tested against). The switch is for A/B measurement and debugging:

- ``PHLOEM_DISABLE_FUSED_KERNELS=1`` in the environment (read on first use), or
- :func:`set_fused_kernels` in the process, before the model runner is built: a captured CUDA
  graph keeps the path that was in force when it was captured.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["fused_kernels_enabled", "set_fused_kernels", "use_fused"]

ENV_DISABLE = "PHLOEM_DISABLE_FUSED_KERNELS"

_enabled: bool | None = None  # None: not decided yet


def set_fused_kernels(enabled: bool) -> None:
    """Turn the fused CUDA kernels on or off for this process (overrides the environment)."""
    global _enabled
    _enabled = bool(enabled) and importlib.util.find_spec("triton") is not None


def fused_kernels_enabled() -> bool:
    """On unless switched off or Triton is missing."""
    if _enabled is None:
        set_fused_kernels(os.environ.get(ENV_DISABLE) != "1")
    assert _enabled is not None
    return _enabled


def use_fused(x: torch.Tensor) -> bool:
    """Whether a layer given ``x`` should call the fused kernel (CUDA tensors, switch on)."""
    return x.is_cuda and (_enabled if _enabled is not None else fused_kernels_enabled())
