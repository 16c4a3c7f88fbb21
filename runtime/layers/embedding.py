"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from phloem.runtime.layers.cpu_matmul import use_weight_major, weight_major_linear
from phloem.runtime.layers.fusion import use_skinny
from phloem.runtime.layers.linear import linear_rows
from torch import nn

if TYPE_CHECKING:
    from phloem.runtime.layers.quant import QuantizedWeight

__all__ = ["LMHead", "VocabEmbedding", "float_out_linear"]


class VocabEmbedding(nn.Module):
    """``weight[ids]`` with ``weight`` of shape ``[vocab, hidden]``."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Hidden states ``[N, H]`` -> float32 logits ``[N, V]``; ``tied_to`` reuses an embedding.

    ``row_tile`` and :meth:`set_quantized` as on :class:`~phloem.runtime.layers.linear.Linear`;
    a quantized head keeps its own copy, so a tied embedding stays float for the lookup.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.tied_to = tied_to
        self.weight = None if tied_to is not None else nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.row_tile = 0
        self.quant: QuantizedWeight | None = None

    @property
    def full_weight(self) -> torch.Tensor:
        """The float ``[V, H]`` weight (the embedding's when tied)."""
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        assert weight is not None, "the LM head weight was quantized"
        return weight

    def set_quantized(self, qweight: QuantizedWeight) -> None:
        self.quant = qweight
        if self.tied_to is None:
            self.register_parameter("weight", None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
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
