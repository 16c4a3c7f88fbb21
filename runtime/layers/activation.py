"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["silu_and_mul"]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused ``[..., 2 * I]`` projection: ``silu(gate) * up`` -> ``[..., I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
