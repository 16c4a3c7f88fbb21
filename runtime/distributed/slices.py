"""Checkpoint tensors as the sharded layers take them, and the vocabulary split.

A tensor reaches a layer either whole or as a lazy safetensors slice
(``safe_open(...).get_slice(name)``), which reads from the file only the rows or columns that
are indexed: a rank then never reads the whole model. Both index the same way (``t[lo:hi]``,
``t[:, lo:hi]``); :func:`shape_of` and :func:`materialize` cover what differs.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["LazySlice", "TensorLike", "materialize", "shape_of", "vocab_range"]


class LazySlice(Protocol):
    """A checkpoint tensor not read yet: indexing reads only the selected rows/columns."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


TensorLike = torch.Tensor | LazySlice


def shape_of(t: TensorLike) -> tuple[int, ...]:
    """The full shape of a tensor or a lazy slice."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t.get_shape())


def materialize(t: TensorLike) -> torch.Tensor:
    """The whole tensor (a replicated parameter: every rank holds all of it)."""
    return t if isinstance(t, torch.Tensor) else t[:]


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank ``rank``'s vocabulary rows: the vocabulary padded up to a multiple of
    ``size``, split evenly (rows at or past ``vocab_size`` are padding: zero weights, trimmed
    logits). Any ``size`` works."""
    share = -(-vocab_size // size)
    return rank * share, (rank + 1) * share
