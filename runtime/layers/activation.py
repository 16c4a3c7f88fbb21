"""Gated activations (one fused kernel on CUDA, :mod:`phloem.runtime.layers.fused_triton`; one C++
call on the CPU, ``cpu_decode_kernels.h``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from phloem.runtime.layers.cpu_ops import cpu_kernels, use_cpu_kernels
from phloem.runtime.layers.fusion import use_fused

__all__ = ["silu_and_mul", "silu_and_mul_ref"]


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused ``[..., 2 * I]`` projection: ``silu(gate) * up`` -> ``[..., I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_and_mul_ref`, fused into one kernel on CUDA and on the CPU (float32 rows; e^x
    by a polynomial there, within a few ulp of torch's)."""
    if use_fused(gate_up):
        from phloem.runtime.layers import fused_triton

        return fused_triton.silu_and_mul(gate_up)
    if use_cpu_kernels(gate_up) and gate_up.shape[-1] % 16 == 0 and gate_up.stride(-1) == 1:
        return cpu_kernels().silu_and_mul(gate_up)
    return silu_and_mul_ref(gate_up)
