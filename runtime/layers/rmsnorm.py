"""RMSNorm: ``x / sqrt(mean(x^2) + eps) * weight``, computed in float32, optionally after a residual add.

With a residual the layer is the decoder's ``norm(x, residual)`` step: ``residual = x + residual``
(in the activation dtype, as a plain ``x + residual`` would round it), then the norm of that sum;
both are returned, so the next sub-layer's output is added to the running sum in the next call.
On CUDA both cases are one fused kernel (:mod:`phloem.runtime.layers.fused_triton`); on the CPU,
float32 rows take one C++ call (:mod:`phloem.runtime.layers.cpu_ops`: torch's RMSNorm is about ten
ops, which cost more than the arithmetic at decode sizes). The torch functions here are the
reference.
"""

from __future__ import annotations

from typing import overload

import torch
from phloem.runtime.layers.cpu_ops import cpu_kernels, use_cpu_kernels
from phloem.runtime.layers.fusion import use_fused
from torch import nn

__all__ = ["RMSNorm", "add_rms_norm_ref", "rms_norm", "rms_norm_ref"]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize over the last axis; returns ``x``'s dtype."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize over the last axis: the fused kernel on CUDA, else the reference."""
    if use_fused(x):
        from phloem.runtime.layers import fused_triton

        return fused_triton.rmsnorm(x, weight, eps)
    if use_cpu_kernels(x) and weight.dtype == torch.float32:
        return cpu_kernels().rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual``; returns ``(rms_norm_ref(residual), residual)``."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``, ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        if use_fused(x):
            from phloem.runtime.layers import fused_triton

            return fused_triton.add_rmsnorm(x, residual, self.weight, self.eps)
        if use_cpu_kernels(x) and residual.dtype == torch.float32 and self.weight.dtype == torch.float32:
            out, total = cpu_kernels().add_rms_norm(x, residual, self.weight, self.eps)
            return out, total
        return add_rms_norm_ref(x, residual, self.weight, self.eps)
