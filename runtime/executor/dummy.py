"""Random weights of a named shape (``--load-format dummy``), seeded so runs are repeatable.

Under tensor parallelism every rank draws each parameter's FULL (one-rank) tensor from the same
seeded generator and keeps its slice (the layer's ``shard_of``), so ``--tp-size N`` computes with
exactly the weights one rank would have drawn.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["init_dummy_weights"]


def init_dummy_weights(model: nn.Module, *, seed: int = 0, std: float = 0.02) -> None:
    """Fill ``model``'s parameters in place: norms get 1, everything else N(0, std).

    Drawn on the CPU with a fixed generator, so the same seed gives the same weights on any device
    and any tensor-parallel size.
    """
    gen = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                owner_name, _, leaf = name.rpartition(".")
                owner = modules[owner_name]
                if hasattr(owner, "shard_of"):  # a tensor-parallel layer: draw whole, keep the slice
                    p.copy_(owner.shard_of(leaf, torch.randn(owner.full_shape(leaf), generator=gen) * std))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
