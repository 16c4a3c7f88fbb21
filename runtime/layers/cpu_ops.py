"""The CPU decode-step kernels of ``cpu_decode_kernels.h`` (bound in ``cpu_decode_kernels.cpp``):
where they apply and how to load them.

A small model's decode step on the CPU is made mostly of per-op overhead: a torch op on a few
hundred floats costs microseconds of dispatch, and RMSNorm alone is about ten of them. These
kernels do such a step's small pieces in one call each (decode attention in
:mod:`phloem.runtime.attention.cpu`, RMSNorm with its residual add in
:mod:`phloem.runtime.layers.rmsnorm`). ``PHLOEM_DISABLE_CPU_DECODE_KERNEL=1`` keeps the torch ops.
"""

from __future__ import annotations

from typing import Any

import torch
from phloem.runtime import switches

__all__ = ["cpu_kernels", "use_cpu_kernels"]

_loaded: list[Any] = []  # [module or None] once decided


def cpu_kernels() -> Any:
    """The compiled extension, or ``None`` (switched off, no AVX2, no compiler)."""
    if _loaded:
        return _loaded[0]
    kernels = None
    if not switches.DISABLE_CPU_DECODE_KERNEL.flag() and torch.backends.cpu.get_cpu_capability() in (
        "AVX2",
        "AVX512",
    ):
        from phloem.runtime.layers.cpu_build import build_extension

        flags = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]
        kernels = build_extension("phloem_cpu_decode", "cpu_decode_kernels.cpp", flags)
    _loaded.append(kernels)
    return kernels


def use_cpu_kernels(x: torch.Tensor) -> bool:
    """Whether ``x`` (float32 rows on the CPU, with autograd off: the kernels have no backward)
    goes to these kernels."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and not torch.is_grad_enabled()
        and cpu_kernels() is not None
    )
