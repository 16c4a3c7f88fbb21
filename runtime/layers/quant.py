"""Weight-only quantized linear layers for the CPU (``--quantization int4|int8``).

Weights are stored in blocks of 32 along the input axis, in the two GGUF layouts that the default
model ships with, and activations stay float32:

- ``int4`` (:class:`Q4Weight`, GGUF Q4_1): per block a scale ``d`` and a minimum ``m``, 4-bit
  ``q`` in ``[0, 15]``; ``w = d * q + m``. Loaded from a Q4_1 GGUF tensor the blocks are copied as
  they are, so the layer computes with exactly the weights of the dequantized checkpoint.
- ``int8`` (:class:`Q8Weight`, GGUF Q8_0): per block a scale ``d``, 8-bit ``q``; ``w = d * q``.
  Quantizing a Q8_0-dequantized tensor gives back its blocks exactly (the block maximum is
  ``127 * d``), which is how the default model's tied embedding becomes the ``int4`` LM head.

The fast path is a small AVX2 C++ kernel (``quant_kernels.cpp``, built on first use with
``torch.utils.cpp_extension``); where it cannot be built the layers dequantize and call
``F.linear`` (correct, slow). The kernel decodes each weight row once per call and dots it with
every activation row in a fixed order, so it is batch invariant. What one call computes::

    for n in range(N):
        w = dequantize(row n)            # float32 [K], bit-identical to the reference
        for m in range(M):
            y[m, n] = dot(x[m], w)       # four 8-lane accumulators, fixed order

The kernel is a decode kernel: it dots every row of ``x`` with the decoded weights, which at
prefill sizes is slower than decoding the whole weight once and calling MKL. Above
``DENSE_MIN_ROWS`` rows the layers therefore do the latter, except in deterministic mode, where
:func:`set_batch_invariant` keeps every call on the kernel so that results do not depend on the
row count.

Under tensor parallelism a rank quantizes its own slice. Blocks run along the input axis, so a
column-parallel slice (whole rows) has exactly the blocks of the full tensor; a row-parallel slice
does when its input columns start and end on block boundaries, which :func:`quantize_model`
checks (a one-line ``ValueError`` otherwise). GGUF Q4_1 blocks are cut the same way, from the
file when they come as a :class:`Q4Source` (a rank then reads only its blocks).

``torch.ops.aten._weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm`` exist in this torch
build but run slower than float32 ``F.linear`` on AVX2 without AVX-512, so they are not used.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from phloem.runtime import switches
from torch import nn

__all__ = [
    "QUANTIZATION_SCHEMES",
    "Q4Weight",
    "Q4Source",
    "QuantizedWeight",
    "Q8Weight",
    "kernels_available",
    "quantize_model",
    "set_batch_invariant",
]

logger = logging.getLogger(__name__)

# ``gguf`` (int8 activations on the file's own blocks) lives in :mod:`phloem.runtime.layers.qdot`;
# ``auto`` picks it on the CPU for a quantized GGUF (``model_runner``)
QUANTIZATION_SCHEMES = ("none", "int8", "int4", "gguf")
BLOCK = 32
DENSE_MIN_ROWS = 32  # from this many activation rows on, dequantize and use F.linear

_kernels: Any = None
_kernels_tried = False
_lock = threading.Lock()


def _load_kernels() -> Any:
    """The compiled extension, or ``None`` where this CPU or toolchain cannot build it."""
    global _kernels, _kernels_tried
    with _lock:
        if _kernels_tried:
            return _kernels
        _kernels_tried = True
        if switches.DISABLE_QUANT_KERNELS.flag():
            return None
        if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
            logger.warning("no AVX2: quantized layers use the slow dequantize-then-matmul path")
            return None
        from phloem.runtime.layers.cpu_build import build_extension

        flags = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
        _kernels = build_extension("phloem_quant_kernels", "quant_kernels.cpp", flags)
        if _kernels is None:  # no compiler, no ninja, ...
            logger.warning("quantized CPU kernels unavailable; using the slow reference path")
        return _kernels


def kernels_available() -> bool:
    """Whether the C++ kernels are (or can be) built here."""
    return _load_kernels() is not None


class _QuantWeight(nn.Module):
    dense_min_rows = DENSE_MIN_ROWS  # 0: always the kernel (batch invariant)

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def _kernel(self, kernels: Any, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K] @ W.T`` -> float32 ``[M, N]``."""
        kernels = _load_kernels()
        if kernels is None or (self.dense_min_rows and x.shape[0] >= self.dense_min_rows):
            return F.linear(x.float(), self.dequantize())
        return self._kernel(kernels, x.float())


class Q4Weight(_QuantWeight):
    """4-bit weight ``[N, K]``, Q4_1 blocks: ``qs`` uint8 ``[N, K/2]``, ``d`` and ``m`` float32 ``[N, K/32]``.

    Within a block of 32, byte ``j`` holds element ``j`` in its low nibble and ``j + 16`` in
    its high nibble (the GGUF order).
    """

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qs", qs.contiguous())
        self.register_buffer("d", d.float().contiguous())
        self.register_buffer("m", m.float().contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 2

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Q4Weight:
        """Round-to-nearest with the block's min and max (as llama.cpp quantizes to Q4_1)."""
        n, k = w.shape
        blocks = w.float().reshape(n, k // BLOCK, BLOCK)
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        d = ((hi - lo) / 15).half().float()
        m = lo.half().float()
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = ((blocks - m[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
        qs = q[..., :16] | (q[..., 16:] << 4)  # [N, K/32, 16]
        return cls(qs.reshape(n, k // 2), d, m)

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[N, K]`` (``d * q + m``; the product is exact, so one rounding as in GGUF)."""
        n, k = self.shape
        qs = self.qs.reshape(n, k // BLOCK, BLOCK // 2)
        q = torch.cat((qs & 15, qs >> 4), dim=-1).float()  # [N, K/32, 32]
        return (q * self.d[..., None] + self.m[..., None]).reshape(n, k)

    def _kernel(self, kernels: Any, x: torch.Tensor) -> torch.Tensor:
        return kernels.q4_linear(x, self.qs, self.d, self.m)


class Q8Weight(_QuantWeight):
    """8-bit weight ``[N, K]``, Q8_0 blocks: ``qs`` int8 ``[N, K]``, ``d`` float32 ``[N, K/32]``."""

    qs: torch.Tensor
    d: torch.Tensor

    def __init__(self, qs: torch.Tensor, d: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qs", qs.contiguous())
        self.register_buffer("d", d.float().contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1]

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Q8Weight:
        """Symmetric round-to-nearest with ``d = max|w| / 127`` per block (llama.cpp's Q8_0)."""
        n, k = w.shape
        blocks = w.float().reshape(n, k // BLOCK, BLOCK)
        d = blocks.abs().amax(-1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = (blocks * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
        return cls(q.reshape(n, k), d)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        return (self.qs.reshape(n, k // BLOCK, BLOCK).float() * self.d[..., None]).reshape(n, k)

    def _kernel(self, kernels: Any, x: torch.Tensor) -> torch.Tensor:
        return kernels.q8_linear(x, self.qs, self.d)


QuantWeight = Q4Weight | Q8Weight
Blocks = tuple[torch.Tensor, ...]  # Q4_1 ``(qs, d, m)`` of a whole tensor
QuantizedWeight = _QuantWeight  # what a layer's ``set_quantized`` takes: any of this module's or qdot's


class Q4Source(Protocol):
    """A Q4_1 tensor read on demand (``weights_gguf.Q4Blocks``): ``(qs, d, m)`` of some rows, or
    of some input columns (multiples of 32) of every row."""

    def rows(self, lo: int, hi: int) -> Blocks: ...

    def cols(self, lo: int, hi: int) -> Blocks: ...


Q4Input = Blocks | Q4Source


def quantize_model(model: nn.Module, scheme: str, *, q4_blocks: Mapping[str, Q4Input] | None = None) -> None:
    """Replace every :class:`Linear` weight and the LM head by a quantized one (in place).

    ``int4``: linear layers :class:`Q4Weight`, the LM head :class:`Q8Weight`. ``int8``: all
    :class:`Q8Weight`. ``q4_blocks`` maps checkpoint names (``...q_proj.weight``) to GGUF Q4_1
    blocks ``(qs, d, m)``, used as they are instead of requantizing; fused projections
    concatenate their parts' blocks. The token embedding stays float (it is only gathered).
    Under tensor parallelism each layer holds its slice and ``q4_blocks`` are full tensors, cut
    here to the same slice.

    Raises
    ------
    ValueError
        When a row-parallel slice does not start and end on a block boundary.
    """
    from phloem.runtime.layers.embedding import LMHead
    from phloem.runtime.layers.linear import ColumnParallelLinear, Linear, MergedLinear, RowParallelLinear

    if scheme not in ("int4", "int8"):
        raise ValueError(f"unknown quantization {scheme!r}; expected int4 or int8 (gguf: qdot)")
    blocks: Mapping[str, Q4Input] = q4_blocks or {}
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            if (
                isinstance(module, RowParallelLinear)
                and module.tp.size > 1
                and (module.cols[0] | module.cols[1]) % BLOCK
            ):
                raise ValueError(
                    f"--quantization {scheme} with --tp-size {module.tp.size}: {name}'s {module.full_in} "
                    f"input features do not split into whole {BLOCK}-wide blocks per rank"
                )
            if scheme == "int8":
                qw: QuantWeight = Q8Weight.from_float(module.weight.data)
            elif isinstance(module, MergedLinear):
                prefix = name.rsplit(".", 1)[0]
                parts = [
                    _rows(blocks.get(f"{prefix}.{part}_proj.weight"), module.part_rows[part])
                    for part in module.offsets
                ]
                qw = _q4_from(parts, module.weight.data, list(module.offsets.values()))
            else:
                source = blocks.get(f"{name}.weight")
                if isinstance(module, ColumnParallelLinear):
                    blk = _rows(source, module.rows)
                elif isinstance(module, RowParallelLinear):
                    blk = _cols(source, module.cols)
                else:
                    blk = _rows(source, (0, module.out_features))
                qw = _q4_from([blk], module.weight.data, [(0, module.weight.shape[0])])
            module.set_quantized(qw)
        elif isinstance(module, LMHead):
            module.set_quantized(Q8Weight.from_float(module.full_weight.data))


def set_batch_invariant(model: nn.Module) -> None:
    """Keep every quantized matmul of ``model`` on the (batch-invariant) kernel."""
    for module in model.modules():
        if isinstance(module, _QuantWeight):
            module.dense_min_rows = 0


def _rows(blk: Q4Input | None, rows: tuple[int, int]) -> Blocks | None:
    """``(qs, d, m)`` of rows ``[lo, hi)`` of a Q4_1 weight (a column-parallel slice)."""
    lo, hi = rows
    if blk is None or not isinstance(blk, tuple):
        return None if blk is None else blk.rows(lo, hi)
    return tuple(t[lo:hi] for t in blk)


def _cols(blk: Q4Input | None, cols: tuple[int, int]) -> Blocks | None:
    """``(qs, d, m)`` of input columns ``[lo, hi)`` (whole blocks) of a Q4_1 weight (a row-parallel
    slice): ``qs`` holds two weights a byte, ``d`` and ``m`` one value a block."""
    lo, hi = cols
    if blk is None or not isinstance(blk, tuple):
        return None if blk is None else blk.cols(lo, hi)
    qs, d, m = blk
    return qs[:, lo // 2 : hi // 2], d[:, lo // BLOCK : hi // BLOCK], m[:, lo // BLOCK : hi // BLOCK]


def _q4_from(parts: list[Blocks | None], weight: torch.Tensor, ranges: list[tuple[int, int]]) -> Q4Weight:
    """Checkpoint blocks for each row range where given, requantized float rows elsewhere."""
    pieces = [
        Q4Weight(*p) if p is not None else Q4Weight.from_float(weight[lo:hi])
        for p, (lo, hi) in zip(parts, ranges)
    ]
    if len(pieces) == 1:
        return pieces[0]
    return Q4Weight(*(torch.cat([getattr(p, key) for p in pieces]) for key in ("qs", "d", "m")))
