"""Few-row projections on the CPU, computed weight-major: ``(W @ x.T).T`` instead of ``x @ W.T``.

A decode batch of a few requests, a speculative verify pass (5-16 tree nodes) and a tree draft
all multiply a handful of rows by weights that are read once per step from DRAM. With MKL on
x86, ``F.linear`` of 2 to 64 rows costs up to twice a one-row call, while the same product
written as ``W @ x.T`` (the weight as the left operand, in the row-major layout it has) costs
barely more than one row. Measured on the 2-core AVX2 machine CI runs on, every weight of
SmolLM2-135M read once per pass, float32, 2 threads (ms per pass, ``F.linear`` / weight-major)::

    rows            1      2      5      8     16     32     64    128
    30 layers      30/29  53/30  66/48  64/46  70/58  93/78 181/139 242/324
    LM head (49k)   8/8   18/5   23/13  22/19  30/19  36/27  53/45   94/91

One row stays on ``F.linear`` (already a matrix-vector product), and so does anything past 64
rows, where the library's blocked GEMM wins. Results equal ``F.linear`` up to float32 rounding
(a different summation order), which is the oracle in the tests. ``PHLOEM_DISABLE_CPU_WEIGHT_MAJOR=1``
or :func:`set_weight_major` turns the route off (A/B measurement).
"""

from __future__ import annotations

import os

import torch

__all__ = ["WEIGHT_MAJOR_MAX_ROWS", "set_weight_major", "use_weight_major", "weight_major_linear"]

ENV_DISABLE = "PHLOEM_DISABLE_CPU_WEIGHT_MAJOR"
WEIGHT_MAJOR_MAX_ROWS = 64

_enabled: bool | None = None  # None: read the environment on first use


def set_weight_major(enabled: bool) -> None:
    global _enabled
    _enabled = bool(enabled)


def use_weight_major(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` should run weight-major: CPU, float32, 2..64 rows, a weight with
    a contiguous last axis, the switch on."""
    if _enabled is None:
        set_weight_major(os.environ.get(ENV_DISABLE) != "1")
    if not (
        _enabled and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
    ):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return 2 <= rows <= WEIGHT_MAJOR_MAX_ROWS and weight.dim() == 2 and weight.stride(-1) == 1


def weight_major_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as ``(weight @ x.T).T`` (contiguous, same shape)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.mm(weight, x2.t()).t().contiguous()  # [M, N]
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])
