"""Which library runs torch's dense matmuls (``F.linear``, ``torch.mm``) on CUDA: ``--gemm-library``.

Projections of more than a few rows (prefill, decode past the few-row kernels) and the LM head go
to torch, which asks cuBLAS by default. cuBLASLt picks other kernels for some of them: on the
Llama-3-8B shape it is faster on the MLP's down projection and the attention output at some row
counts, level elsewhere, and the whole offline run is faster with it
(``docs/performance-notes.md``). For the small shapes (hidden size 576-1,024) neither library
wins at any row count, so ``auto`` leaves torch's choice alone there.

torch keeps the choice per process; the model runner sets it in the process that owns the model
(the scheduler's), before it captures the decode graphs.
"""

from __future__ import annotations

import torch

__all__ = ["GEMM_LIBRARIES", "LT_MIN_HIDDEN", "apply_gemm_library", "resolve_gemm_library"]

GEMM_LIBRARIES = ("auto", "cublas", "cublaslt")
LT_MIN_HIDDEN = 4096  # hidden sizes from which ``auto`` picks cuBLASLt (Llama-3-8B's width)


def resolve_gemm_library(choice: str, hidden_size: int, device_type: str) -> str | None:
    """The library to select (``"cublas"`` or ``"cublaslt"``), or ``None`` to leave torch's
    choice as it is (off CUDA, and ``auto`` on models narrower than :data:`LT_MIN_HIDDEN`)."""
    if choice not in GEMM_LIBRARIES:
        raise ValueError(f"--gemm-library {choice}: expected one of {', '.join(GEMM_LIBRARIES)}")
    if device_type != "cuda":
        return None
    if choice == "auto":
        return "cublaslt" if hidden_size >= LT_MIN_HIDDEN else None
    return choice


def apply_gemm_library(choice: str, hidden_size: int, device: torch.device) -> str:
    """Select the library :func:`resolve_gemm_library` names (before any CUDA graph is captured:
    a graph keeps the kernels it recorded); return the one torch now uses (``"cpu"`` off CUDA)."""
    lib = resolve_gemm_library(choice, hidden_size, device.type)
    if device.type != "cuda":
        return "cpu"
    if lib is not None:
        torch.backends.cuda.preferred_blas_library(lib)
    return str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1].lower()
