"""Few-row projections on the CPU, computed weight-major: ``(W @ x.T).T`` instead of ``x @ W.T``.

A decode batch of a few requests, a speculative verify pass and a tree draft multiply a handful
of rows by weights read once per step from DRAM. Which of the two orders is faster depends on the
machine and its math library. ms per pass, every weight of SmolLM2-135M read once, float32,
2 threads (``F.linear`` / weight-major)::

    rows                         2      5      8     12     16     32     64
    2-core AVX2, 2026-11-30
      30 layers                53/30  66/48  64/46         70/58  93/78 181/139
      LM head (49k x 576)      18/5   23/13  22/19         30/19  36/27  53/45
    2-core Xeon, torch 2.13, 2026-12-01
      30 layers                21/43  35/44  43/45  50/46  52/44  71/58 103/121
      LM head                   5/12  12/13  18/14  24/14  12/15  17/19  27/38

On the first machine weight-major won everywhere; on the second it costs up to 2x from 2 to 8
rows and on the LM head, and wins 8-18% from 12 to 32 rows on the layers. The route is taken only
where it won on both: 12 to 32 rows, weights of at most 8M elements (the layers, not an LM
head). Results equal ``F.linear`` up to float32 rounding (another summation order), which is the
oracle in the tests. ``PHLOEM_DISABLE_CPU_WEIGHT_MAJOR=1`` or :func:`set_weight_major` turns the
route off (A/B measurement).
"""

from __future__ import annotations

import os

import torch

__all__ = [
    "WEIGHT_MAJOR_MAX_ELEMENTS",
    "WEIGHT_MAJOR_MAX_ROWS",
    "WEIGHT_MAJOR_MIN_ROWS",
    "set_weight_major",
    "use_weight_major",
    "weight_major_linear",
]

ENV_DISABLE = "PHLOEM_DISABLE_CPU_WEIGHT_MAJOR"
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
        set_weight_major(os.environ.get(ENV_DISABLE) != "1")
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
