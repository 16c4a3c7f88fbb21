"""Few-row projections on the CPU, computed weight-major: ``(W @ x.T).T`` instead of ``x @ W.T``.

A decode batch of a few requests, a speculative verify pass and a tree draft multiply a handful
of rows by weights read once per step from DRAM. Which of the two orders is faster depends on the
machine and its math library: ``F.linear`` of a few rows packs the weight's panels, which can
cost up to twice a one-row call, while ``W @ x.T`` reads the weight in its own row-major layout.
Below 12 rows and on an LM head some machines lose with weight-major. The route is taken only
where it wins on every machine tried: 12 to 32 rows, weights of at most 8M elements (the layers,
not an LM head). Results equal ``F.linear`` up to float32 rounding (another summation order), which is the
oracle in the tests. ``PHLOEM_DISABLE_CPU_WEIGHT_MAJOR=1`` or :func:`set_weight_major` turns the
route off (A/B measurement).
"""

from __future__ import annotations

import torch
from phloem.runtime import switches

__all__ = [
    "WEIGHT_MAJOR_MAX_ELEMENTS",
    "WEIGHT_MAJOR_MAX_ROWS",
    "WEIGHT_MAJOR_MIN_ROWS",
    "set_weight_major",
    "use_weight_major",
    "weight_major_linear",
]

ENV_DISABLE = switches.DISABLE_CPU_WEIGHT_MAJOR.name
WEIGHT_MAJOR_MIN_ROWS = 12
WEIGHT_MAJOR_MAX_ROWS = 32
WEIGHT_MAJOR_MAX_ELEMENTS = 1 << 23

_enabled: bool | None = None  # None: read the environment on first use


def set_weight_major(enabled: bool) -> None:
    global _enabled
    _enabled = bool(enabled)


def use_weight_major(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` should run weight-major: CPU, float32, 12..32 rows, a weight of at
    most 8M elements with a contiguous last axis, the switch on."""
    if _enabled is None:
        set_weight_major(not switches.DISABLE_CPU_WEIGHT_MAJOR.flag())
    if not (
        _enabled and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
    ):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        WEIGHT_MAJOR_MIN_ROWS <= rows <= WEIGHT_MAJOR_MAX_ROWS
        and weight.dim() == 2
        and weight.numel() <= WEIGHT_MAJOR_MAX_ELEMENTS
        and weight.stride(-1) == 1
    )


def weight_major_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as ``(weight @ x.T).T`` (contiguous, same shape)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.mm(weight, x2.t()).t().contiguous()  # [M, N]
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])
