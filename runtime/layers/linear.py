"""Linear layers, including fused projections loaded from separate checkpoint tensors.

Single-rank only for now: the tensor-parallel split would slice ``weight`` along the output axis
(column parallel) or the input axis (row parallel) at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Linear", "MergedLinear"]


class Linear(nn.Module):
    """``y = x @ weight.T (+ bias)`` with ``weight`` of shape ``[out, in]`` (HF layout)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output axis (one matmul).

    ``parts`` names each slice with its width, e.g. ``{"q": 576, "k": 192, "v": 192}``;
    :meth:`load_part` copies a checkpoint tensor into its slice.
    """

    def __init__(self, in_features: int, parts: dict[str, int], *, bias: bool = False) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, width in parts.items():
            self.offsets[name] = (start, start + width)
            start += width

    def load_part(self, name: str, tensor: torch.Tensor, *, is_bias: bool = False) -> None:
        """Copy ``tensor`` (``[width, in]`` or ``[width]`` for a bias) into slice ``name``."""
        lo, hi = self.offsets[name]
        target = self.bias if is_bias else self.weight
        assert target is not None, "this projection has no bias"
        if tensor.shape[0] != hi - lo:
            raise ValueError(f"part {name}: expected {hi - lo} rows, got {tuple(tensor.shape)}")
        with torch.no_grad():
            target[lo:hi].copy_(tensor)
