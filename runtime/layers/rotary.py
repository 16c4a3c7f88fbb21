"""Rotary position embedding (neox / HF "rotate half" layout), with Llama-3 frequency scaling.

The cos/sin table covers every position up to the context length and is indexed by each token's
absolute position, so ragged batches need no padding. On CUDA the rotation of q and k is one fused
kernel that works in place (:func:`phloem.runtime.layers.fused_triton.rope_`); :func:`rope_ref`
is the reference and the CPU path.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from phloem.runtime.layers.fusion import use_fused
from torch import nn

__all__ = ["RotaryEmbedding", "rope_inv_freq", "rope_ref"]


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (float32), Llama-3 scaled when ``scaling`` says so.

    Llama-3 scaling keeps high frequencies (wavelength < original_ctx / high_freq_factor), divides
    low ones (wavelength > original_ctx / low_freq_factor) by ``factor``, and interpolates
    smoothly in between.
    """
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv.float()
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > old_ctx / low, inv / factor, scaled)
    out = torch.where(wavelen < old_ctx / high, inv, out)
    return out.float()


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q ``[T, Hq, D]`` and k ``[T, Hk, D]`` at absolute ``positions`` ``[T]``."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)  # [P, D/2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for ``positions`` ``[T]``, shaped ``[T, 1, D/2]``; look up once per forward."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(  # type: ignore[override]  # rotation, not nn.Module.apply
        q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` and ``k`` with tables from :meth:`cos_sin`; use the returned tensors.

        On CUDA (fused kernels on) ``q`` and ``k`` are rotated in place and returned; elsewhere
        they are left as they are and new tensors are returned.
        """
        if use_fused(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
            from phloem.runtime.layers import fused_triton

            return fused_triton.rope_(q, k, *cos_sin)
        return rope_ref(q, k, cos_sin)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply(q, k, self.cos_sin(positions))


def rope_ref(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` (float32 arithmetic) with
    tables ``[T, 1, D/2]``."""
    cos, sin = cos_sin
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)  # [T, H, D/2] each
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
