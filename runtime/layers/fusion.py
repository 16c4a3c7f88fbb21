"""Whether CUDA layers use the fused Triton kernels of :mod:`phloem.runtime.layers.fused_triton`.

On CUDA, RMSNorm (with its residual add), SiLU x mul and RoPE each run one fused kernel; on the
CPU, and on CUDA with the kernels switched off, they run their torch reference (the oracle the
kernels are tested against). The switch is for A/B measurement and debugging:

- ``PHLOEM_DISABLE_FUSED_KERNELS=1`` in the environment (read on first use), or
- :func:`set_fused_kernels` in the process, before the model runner is built: a captured CUDA
  graph keeps the path that was in force when it was captured.

Projections of at most 16 rows (decode, verify, drafting) take the skinny matmul kernel of
:mod:`phloem.runtime.layers.skinny_gemm` on CUDA in 16-bit dtypes; ``PHLOEM_DISABLE_SKINNY_GEMM=1``
or :func:`set_skinny_gemm` sends them back to the GEMM library (``F.linear``), their oracle.

A decoder layer of 1-16 rows (small-batch decode, a verify pass) also folds each RMSNorm into the
projection after it, and SiLU x mul into the MLP's gate/up projection
(:mod:`phloem.runtime.layers.row_fused`): always at one row, at 2-16 rows where the weight is small
enough that the separate kernels cost their launches (``row_fused.rows_fusion_wins``);
``PHLOEM_DISABLE_ROW_FUSION=1`` or :func:`set_row_fusion` keeps the separate kernels.
"""

from __future__ import annotations

import importlib.util

import torch
from phloem.runtime import switches

__all__ = [
    "fused_kernels_enabled",
    "set_fused_kernels",
    "set_row_fusion",
    "set_skinny_gemm",
    "skinny_gemm_enabled",
    "use_fused",
    "use_row_fusion",
    "use_skinny",
]

ENV_DISABLE = switches.DISABLE_FUSED_KERNELS.name

_enabled: bool | None = None  # None: not decided yet


def set_fused_kernels(enabled: bool) -> None:
    """Turn the fused CUDA kernels on or off for this process (overrides the environment)."""
    global _enabled
    _enabled = bool(enabled) and importlib.util.find_spec("triton") is not None


def fused_kernels_enabled() -> bool:
    """On unless switched off or Triton is missing."""
    if _enabled is None:
        set_fused_kernels(not switches.DISABLE_FUSED_KERNELS.flag())
    assert _enabled is not None
    return _enabled


def use_fused(x: torch.Tensor) -> bool:
    """Whether a layer given ``x`` should call the fused kernel (CUDA tensors, switch on)."""
    return x.is_cuda and (_enabled if _enabled is not None else fused_kernels_enabled())


# ---- few-row matmuls (runtime/layers/skinny_gemm.py) ---------------------------------------------
ENV_DISABLE_SKINNY = switches.DISABLE_SKINNY_GEMM.name
SKINNY_MAX_ROWS = 16  # = skinny_gemm.MAX_ROWS (not imported: that module needs Triton)
_SKINNY_DTYPES = (torch.float16, torch.bfloat16)
_skinny: bool | None = None


def set_skinny_gemm(enabled: bool) -> None:
    """Route few-row CUDA projections through the skinny kernel (on) or the GEMM library (off),
    before the model runner is built (a captured graph keeps the path in force at capture)."""
    global _skinny
    _skinny = bool(enabled) and importlib.util.find_spec("triton") is not None


def skinny_gemm_enabled() -> bool:
    """On unless ``PHLOEM_DISABLE_SKINNY_GEMM=1``, the fused kernels are off, or Triton is missing."""
    if _skinny is None:
        set_skinny_gemm(not switches.DISABLE_SKINNY_GEMM.flag())
    assert _skinny is not None
    return _skinny and fused_kernels_enabled()


def _triton_projection(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """CUDA, 16-bit, a weight with a contiguous last axis, the switch on: what every few-row
    Triton projection needs."""
    return bool(
        x.is_cuda
        and x.dtype in _SKINNY_DTYPES
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
        and skinny_gemm_enabled()
    )


def use_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` should run the skinny kernel: :func:`_triton_projection`, at most
    :data:`SKINNY_MAX_ROWS` rows, a shape where the kernel is the faster one
    (``skinny_gemm.skinny_wins``)."""
    if x.numel() > SKINNY_MAX_ROWS * x.shape[-1] or not _triton_projection(x, weight):
        return False
    from phloem.runtime.layers.skinny_gemm import skinny_wins

    n, k = weight.shape
    return skinny_wins(n, k, x.numel() // max(k, 1))


# ---- few-row layers with the norm folded in (runtime/layers/row_fused.py) ------------------------
ENV_DISABLE_ROW_FUSION = switches.DISABLE_ROW_FUSION.name
ROW_FUSION_MAX_ROWS = 256  # = row_fused.MAX_ROWS (not imported: that module needs Triton)
_row_fusion: bool | None = None


def set_row_fusion(enabled: bool) -> None:
    """Fold norms (and SiLU x mul) into one-row projections (on) or not, before the model runner
    is built (a captured graph keeps the path in force at capture)."""
    global _row_fusion
    _row_fusion = bool(enabled)


def use_row_fusion(x: torch.Tensor, linear: torch.nn.Module) -> bool:
    """Whether the norm before ``linear`` (a :class:`~phloem.runtime.layers.linear.Linear`) folds
    into it for input ``x`` ``[M, K]``: a float weight that the Triton projections take, a shape
    and row count where folding wins (``row_fused.rows_fusion_wins``), the switch on."""
    if _row_fusion is None:
        set_row_fusion(not switches.DISABLE_ROW_FUSION.flag())
    weight = getattr(linear, "weight", None)
    if not (
        _row_fusion
        and x.dim() == 2
        and x.shape[0] <= ROW_FUSION_MAX_ROWS  # a prefill pass stops here
        and weight is not None
        and getattr(linear, "quant", None) is None
        and not getattr(linear, "row_tile", 0)
        and _triton_projection(x, weight)
    ):
        return False
    from phloem.runtime.layers.row_fused import rows_fusion_wins

    n, k = weight.shape
    return rows_fusion_wins(n, k, x.shape[0])
