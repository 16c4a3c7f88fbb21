"""Token embedding and the LM head (which may share the embedding's weight).

Under tensor parallelism both split the vocabulary (``distributed.slices.vocab_range``): the
vocabulary is padded up to a multiple of the rank count and each rank holds an equal range of
rows (padding rows are zero). The embedding looks up the ids in its range, zeroes the rows of the
others and all-reduces, so every rank gets every row; the LM head computes its range's logits and
all-gathers them along the vocabulary, then drops the padding, so every rank holds the same float32
``[N, V]``. A tied head uses the embedding's rows, which are the same range. With one rank the
range is the whole vocabulary and ``forward`` is unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from phloem.runtime.distributed.slices import TensorLike, vocab_range
from phloem.runtime.distributed.state import TPGroup, get_tp
from phloem.runtime.layers.cpu_matmul import use_weight_major, weight_major_linear
from phloem.runtime.layers.fusion import use_skinny
from phloem.runtime.layers.linear import linear_rows
from torch import nn

if TYPE_CHECKING:
    from phloem.runtime.layers.quant import QuantizedWeight

__all__ = ["LMHead", "VocabEmbedding", "float_out_linear"]


class _VocabRows:
    """The vocabulary rows this rank holds (:func:`vocab_range`) and how to cut them from a full
    ``[vocab, hidden]`` checkpoint tensor."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.vocab_start, self.vocab_end = vocab_range(vocab_size, tp.rank, tp.size)

    def full_shape(self) -> tuple[int, ...]:
        return (self.vocab_size, self.hidden_size)

    def shard_of(self, full: TensorLike) -> torch.Tensor:
        """This rank's rows of ``full``, zero rows past the vocabulary."""
        lo, hi = self.vocab_start, self.vocab_end
        rows = full[lo : min(hi, self.vocab_size)] if lo < self.vocab_size else None
        if rows is not None and rows.shape[0] == hi - lo:
            return rows
        pad = torch.zeros(hi - lo - (0 if rows is None else rows.shape[0]), self.hidden_size)
        return pad if rows is None else torch.cat((rows, pad.to(rows.dtype)))


class VocabEmbedding(nn.Module):
    """``weight[ids]`` with ``weight`` of shape ``[vocab, hidden]`` (this rank's vocabulary rows)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = get_tp()
        self.rows = _VocabRows(vocab_size, hidden_size, self.tp)
        self.weight = nn.Parameter(torch.empty(self.rows.vocab_end - self.rows.vocab_start, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.rows.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def full_shape(self, leaf: str) -> tuple[int, ...]:
        """Shape of the full (one-rank) weight."""
        return self.rows.full_shape()

    def shard_of(self, leaf: str, full: TensorLike) -> torch.Tensor:
        """This rank's vocabulary rows of the full weight."""
        return self.rows.shard_of(full)


class LMHead(nn.Module):
    """Hidden states ``[N, H]`` -> float32 logits ``[N, V]``; ``tied_to`` reuses an embedding.

    ``row_tile`` and :meth:`set_quantized` as on :class:`~phloem.runtime.layers.linear.Linear`;
    a quantized head keeps its own copy, so a tied embedding stays float for the lookup.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.tp = get_tp()
        self.rows = _VocabRows(vocab_size, hidden_size, self.tp)
        self.tied_to = tied_to
        local = self.rows.vocab_end - self.rows.vocab_start
        self.weight = None if tied_to is not None else nn.Parameter(torch.empty(local, hidden_size))
        self.row_tile = 0
        self.quant: QuantizedWeight | None = None

    @property
    def full_weight(self) -> torch.Tensor:
        """The float ``[V, H]`` weight (the embedding's when tied; this rank's rows under tensor
        parallelism)."""
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        assert weight is not None, "the LM head weight was quantized"
        return weight

    def set_quantized(self, qweight: QuantizedWeight) -> None:
        self.quant = qweight
        if self.tied_to is None:
            self.register_parameter("weight", None)

    def full_shape(self, leaf: str) -> tuple[int, ...]:
        """Shape of the full (one-rank) weight."""
        return self.rows.full_shape()

    def shard_of(self, leaf: str, full: TensorLike) -> torch.Tensor:
        """This rank's vocabulary rows of the full weight."""
        return self.rows.shard_of(full)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._logits(hidden)
        logits = self.tp.all_gather(self._logits(hidden), dim=-1)  # [N, padded V], rank order
        vocab = self.rows.vocab_size
        return logits if logits.shape[-1] == vocab else logits[..., :vocab].contiguous()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of this rank's vocabulary rows."""
        if self.quant is not None:
            return self.quant.matmul(hidden)
        if self.row_tile:
            return linear_rows(hidden, self.full_weight, tile=self.row_tile).float()
        weight = self.full_weight
        if use_skinny(hidden, weight):  # float32 logits straight from the float32 accumulator
            from phloem.runtime.layers.skinny_gemm import skinny_linear

            return skinny_linear(hidden, weight, out_dtype=torch.float32)
        if use_weight_major(hidden, weight):
            return weight_major_linear(hidden, weight)
        return float_out_linear(hidden, weight)


_MM_OUT_DTYPE: bool | None = None  # whether this torch's CUDA ``mm`` takes ``out_dtype``


def float_out_linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(hidden, weight)`` as float32 ``[N, V]``.

    On CUDA with 16-bit operands the GEMM writes its float32 accumulator directly
    (``torch.mm(..., out_dtype=torch.float32)``): no 16-bit rounding of the logits, and no second
    kernel reading ``[N, V]`` back to widen it (at a few hundred rows of a large vocabulary that
    pass costs more than the GEMM's own epilogue). Elsewhere, or on a torch without
    ``out_dtype``, the 16-bit product widened.
    """
    global _MM_OUT_DTYPE
    if (
        _MM_OUT_DTYPE is not False
        and hidden.is_cuda
        and hidden.dim() == 2
        and hidden.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == hidden.dtype
    ):
        try:
            out = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
            _MM_OUT_DTYPE = True
            return out
        except (TypeError, RuntimeError):
            if _MM_OUT_DTYPE:  # it worked before: this failure is not about the torch version
                raise
            _MM_OUT_DTYPE = False
    return F.linear(hidden, weight).float()
