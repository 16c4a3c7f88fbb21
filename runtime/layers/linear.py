"""Linear layers, including fused projections loaded from separate checkpoint tensors.

Tensor parallelism (``runtime/distributed/state.py``) splits a layer's weight at construction:

- column parallel (:class:`ColumnParallelLinear`, :class:`MergedLinear`): each rank holds a range
  of output rows and computes its slice of the output; no communication. A fused projection splits
  each part on its own (q, k and v, or gate and up) and stacks the rank's slices, so the rank's
  output is again "its q | its k | its v".
- row parallel (:class:`RowParallelLinear`): each rank holds a range of input columns, multiplies
  the matching slice of the input (the column-parallel output before it) and the partial sums are
  all-reduced; the bias is added once, after the reduce.

Sharded layers take FULL checkpoint tensors (or lazy safetensors slices, which then read only the
rank's rows or columns) and keep their share: :meth:`MergedLinear.load_part`, and for single
tensors ``full_shape`` / ``shard_of`` (also used by dummy weights, which draw the full tensor and
keep the slice). With one rank every range is the whole tensor and ``forward`` is unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from phloem.runtime.distributed.slices import TensorLike, materialize, shape_of
from phloem.runtime.distributed.state import get_tp, shard_range
from phloem.runtime.layers.cpu_matmul import use_weight_major, weight_major_linear
from phloem.runtime.layers.fusion import use_skinny
from torch import nn

if TYPE_CHECKING:
    from phloem.runtime.layers.quant import QuantizedWeight

__all__ = [
    "BATCH_INVARIANT_ROW_TILE",
    "ColumnParallelLinear",
    "Linear",
    "MergedLinear",
    "RowParallelLinear",
    "linear_rows",
]

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
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.row_tile = 0
        self.quant: QuantizedWeight | None = None

    def set_quantized(self, qweight: QuantizedWeight) -> None:
        """Compute with ``qweight`` from now on; the float weight is released."""
        self.quant = qweight
        self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._project(x, self.bias)

    def _project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant.matmul(x.reshape(-1, x.shape[-1])).to(x.dtype)
            y = y.reshape(*x.shape[:-1], y.shape[-1])
        elif self.row_tile:
            y = linear_rows(x, self.weight, tile=self.row_tile)
        elif use_skinny(x, self.weight):
            from phloem.runtime.layers.skinny_gemm import skinny_linear

            return skinny_linear(x, self.weight, bias)
        elif use_weight_major(x, self.weight):
            return weight_major_linear(x, self.weight, bias)
        else:
            return F.linear(x, self.weight, bias)
        return y + bias if bias is not None else y


class ColumnParallelLinear(Linear):
    """:class:`Linear` whose rank holds output rows ``rows = [lo, hi)`` of the full
    ``[out_features, in_features]`` weight (default: an equal share); its output is that slice."""

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool = False, rows: tuple[int, int] | None = None
    ) -> None:
        tp = get_tp()
        lo, hi = (
            rows if rows is not None else shard_range(out_features, tp.rank, tp.size, what="output features")
        )
        super().__init__(in_features, hi - lo, bias=bias)
        self.full_out, self.rows = out_features, (lo, hi)

    def full_shape(self, leaf: str) -> tuple[int, ...]:
        """Shape of the full (one-rank) parameter ``leaf`` (``weight`` or ``bias``)."""
        return (self.full_out, self.in_features) if leaf == "weight" else (self.full_out,)

    def shard_of(self, leaf: str, full: TensorLike) -> torch.Tensor:
        """This rank's rows of the full parameter ``leaf``."""
        lo, hi = self.rows
        return full[lo:hi]


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output axis (one matmul),
    column parallel part by part.

    ``parts`` names each part with its full (checkpoint) width, e.g. ``{"q": 576, "k": 192,
    "v": 192}``. ``rows`` gives this rank's ``[lo, hi)`` of a part's rows (default: an equal
    share of each part; attention passes its heads' rows). ``offsets[name]``: where the rank's
    slice of part ``name`` lies in :attr:`weight`. :meth:`load_part` takes the full checkpoint
    tensor of a part and copies this rank's rows.
    """

    def __init__(
        self,
        in_features: int,
        parts: dict[str, int],
        *,
        bias: bool = False,
        rows: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        tp = get_tp()
        self.part_rows: dict[str, tuple[int, int]] = {}
        for name, width in parts.items():
            given = (rows or {}).get(name)
            self.part_rows[name] = given or shard_range(
                width, tp.rank, tp.size, what=f"{name} projection rows"
            )
        super().__init__(in_features, sum(hi - lo for lo, hi in self.part_rows.values()), bias=bias)
        self.full_widths = dict(parts)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, (lo, hi) in self.part_rows.items():
            self.offsets[name] = (start, start + hi - lo)
            start += hi - lo

    def load_part(self, name: str, tensor: TensorLike, *, is_bias: bool = False) -> None:
        """Copy this rank's rows of ``tensor`` (the full part, ``[width, in]`` or ``[width]`` for
        a bias) into slice ``name``."""
        lo, hi = self.offsets[name]
        target = self.bias if is_bias else self.weight
        assert target is not None, "this projection has no bias (or its weight is quantized)"
        shape = shape_of(tensor)
        if shape[0] != self.full_widths[name]:
            raise ValueError(f"part {name}: expected {self.full_widths[name]} rows, got {shape}")
        a, b = self.part_rows[name]
        with torch.no_grad():
            target[lo:hi].copy_(tensor[a:b])

    def full_shape(self, leaf: str) -> tuple[int, ...]:
        """Shape of the full (one-rank) fused parameter ``leaf`` (``weight`` or ``bias``)."""
        rows = sum(self.full_widths.values())
        return (rows, self.in_features) if leaf == "weight" else (rows,)

    def shard_of(self, leaf: str, full: TensorLike) -> torch.Tensor:
        """This rank's rows of the full fused parameter ``leaf``, part by part."""
        pieces, start = [], 0
        for name, width in self.full_widths.items():
            lo, hi = self.part_rows[name]
            pieces.append(full[start + lo : start + hi])
            start += width
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class RowParallelLinear(Linear):
    """:class:`Linear` whose rank holds input columns ``cols = [lo, hi)`` of the full
    ``[out_features, in_features]`` weight (default: an equal share) and takes the matching slice
    of the input; the ranks' partial outputs are summed (all-reduce), then the bias is added."""

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool = False, cols: tuple[int, int] | None = None
    ) -> None:
        tp = get_tp()
        lo, hi = (
            cols if cols is not None else shard_range(in_features, tp.rank, tp.size, what="input features")
        )
        super().__init__(hi - lo, out_features, bias=bias)
        self.tp, self.full_in, self.cols = tp, in_features, (lo, hi)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._project(x, self.bias)
        y = self.tp.all_reduce(self._project(x, None))
        return y + self.bias if self.bias is not None else y

    def full_shape(self, leaf: str) -> tuple[int, ...]:
        """Shape of the full (one-rank) parameter ``leaf`` (``weight`` or ``bias``)."""
        return (self.out_features, self.full_in) if leaf == "weight" else (self.out_features,)

    def shard_of(self, leaf: str, full: TensorLike) -> torch.Tensor:
        """This rank's columns of the full weight; the whole bias (every rank adds it)."""
        if leaf != "weight":
            return materialize(full)
        lo, hi = self.cols
        return full[:, lo:hi]
