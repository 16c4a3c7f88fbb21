"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LMHead", "VocabEmbedding"]


class VocabEmbedding(nn.Module):
    """``weight[ids]`` with ``weight`` of shape ``[vocab, hidden]``."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Hidden states ``[N, H]`` -> float32 logits ``[N, V]``; ``tied_to`` reuses an embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.tied_to = tied_to
        self.weight = None if tied_to is not None else nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        return F.linear(hidden, weight).float()
