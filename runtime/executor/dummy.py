"""Random weights of a named shape (``--load-format dummy``), seeded so runs are repeatable."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["init_dummy_weights"]


def init_dummy_weights(model: nn.Module, *, seed: int = 0, std: float = 0.02) -> None:
    """Fill ``model``'s parameters in place: norms get 1, everything else N(0, std).

    Drawn on the CPU with a fixed generator, so the same seed gives the same weights on any device.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
