"""Linear layers, including fused projections loaded from separate checkpoint tensors.

Single-rank only for now: the tensor-parallel split would slice ``weight`` along the output axis
(column parallel) or the input axis (row parallel) at load time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from phloem.runtime.layers.cpu_matmul import use_weight_major, weight_major_linear
from phloem.runtime.layers.fusion import use_skinny
from torch import nn

if TYPE_CHECKING:
    from phloem.runtime.layers.quant import QuantizedWeight

__all__ = ["BATCH_INVARIANT_ROW_TILE", "Linear", "MergedLinear", "linear_rows"]

# Rows per matmul call in deterministic mode. With MKL a row of ``x @ W.T`` is bit-identical
# whatever the other rows hold as long as every call has the same row count (the library picks
# its kernel by shape).
BATCH_INVARIANT_ROW_TILE = 16


def linear_rows(x: torch.Tensor, weight: torch.Tensor, *, tile: int) -> torch.Tensor:
    """``x @ weight.T`` in calls of exactly ``tile`` rows (the last one zero-padded).

    Each output row then depends only on its input row, not on the batch around it::

        for i in range(0, M, tile):
            y[i : i + tile] = pad(x[i : i + tile], tile) @ weight.T
    """
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    m = x2.shape[0]
    pad = -m % tile
    if pad:
        x2 = torch.cat((x2, x2.new_zeros(pad, x2.shape[1])))
    out = x2.new_empty(m + pad, weight.shape[0])
    wt = weight.t()
    for i in range(0, m + pad, tile):
        torch.mm(x2[i : i + tile], wt, out=out[i : i + tile])
    return out[:m].reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Module):
    """``y = x @ weight.T (+ bias)`` with ``weight`` of shape ``[out, in]`` (HF layout).

    Two switches, set once at load time by the model runner: ``row_tile`` (deterministic mode,
    see :func:`linear_rows`) and :meth:`set_quantized` (weight-only quantization, which drops the
    float weight).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.row_tile = 0
        self.quant: QuantizedWeight | None = None

    def set_quantized(self, qweight: QuantizedWeight) -> None:
        """Compute with ``qweight`` from now on; the float weight is released."""
        self.quant = qweight
        self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant.matmul(x.reshape(-1, x.shape[-1])).to(x.dtype)
            y = y.reshape(*x.shape[:-1], y.shape[-1])
        elif self.row_tile:
            y = linear_rows(x, self.weight, tile=self.row_tile)
        elif use_skinny(x, self.weight):
            from phloem.runtime.layers.skinny_gemm import skinny_linear

            return skinny_linear(x, self.weight, self.bias)
        elif use_weight_major(x, self.weight):
            return weight_major_linear(x, self.weight, self.bias)
        else:
            return F.linear(x, self.weight, self.bias)
        return y + self.bias if self.bias is not None else y


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
        assert target is not None, "this projection has no bias (or its weight is quantized)"
        if tensor.shape[0] != hi - lo:
            raise ValueError(f"part {name}: expected {hi - lo} rows, got {tuple(tensor.shape)}")
        with torch.no_grad():
            target[lo:hi].copy_(tensor)
