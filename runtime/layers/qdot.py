"""Linear layers that compute on a GGUF's own blocks with int8 activations (``--quantization gguf``).

What llama.cpp does on the CPU, in our own kernel: the weights stay in their GGUF blocks of 32
(Q4_1 for the default model's layers, Q8_0 for its tied embedding, which is the LM head), each
activation row is quantized per block of 32 to int8 with one float scale, and each block's dot
product is an exact integer sum, scaled once in float32::

    xq, dx = round(x / (max|x| / 127)), max|x| / 127           # per row and block of 32
    Q4_1:  y[m, n] = sum_g isum(q[n, g], xq[m, g]) * (dw * dx) + mw * (dx * sum(xq[m, g]))
    Q8_0:  y[m, n] = sum_g isum(q[n, g], xq[m, g]) * (dw * dx)

A decode step then reads 4.5-8.5 bits per weight instead of 32, and the multiply-adds are byte
dot products (``qdot_kernels.h``: AVX-512 VNNI where the CPU has it, chosen at run time, else
AVX2). Each output depends only on its own activation row, so the layers are batch invariant.
The weights are repacked once at load into tiles of 8 output rows, in the order the kernel reads
them (:func:`pack_q4`, :func:`pack_q8`; scales stay float16, so a tile costs what the GGUF block
does). :func:`reference_matmul` is the same computation in plain torch, in the same float order;
the kernel matches it bit for bit, and it is the path where the kernel cannot be built.

Compared with float32 activations the int8 rounding changes logits slightly: greedy outputs of
the default model agree with ``--quantization none`` for most tokens, not all (the agreement
table is ``tests/unit/test_qdot_agreement.py``).
"""

from __future__ import annotations

from typing import Any, TypeAlias

import torch
import torch.nn.functional as F
from phloem.runtime import switches
from phloem.runtime.layers.quant import BLOCK, Q4Weight, Q8Weight, _QuantWeight
from torch import nn

__all__ = [
    "Q4DotWeight",
    "Q8DotWeight",
    "build_kernels",
    "kernels_isa",
    "pack_q4",
    "pack_q8",
    "q8_blocks_from_float",
    "quantize_activations_ref",
    "quantize_model_gguf",
    "reference_matmul",
    "supported_isas",
]

TILE = 8  # output rows per packed tile
Q4_RECORD, Q8_RECORD = 160, 272  # bytes per tile and block of 32 (quants + float16 scales)

ISAS = ("avx512vnni", "avx2")
_ISA_FLAGS = {
    "avx2": [],
    "avx512vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-DPHLOEM_QDOT_VNNI"],
}


def supported_isas() -> list[str]:
    """The kernel variants this CPU runs, fastest first (empty without AVX2)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return []
    is_vnni = getattr(torch.cpu, "_is_vnni_supported", None)
    # every CPU with VNNI on 512-bit registers has VL, which the 256-bit form needs
    vnni = capability == "AVX512" and is_vnni is not None and bool(is_vnni())
    return ["avx512vnni", "avx2"] if vnni else ["avx2"]


def build_kernels(isa: str) -> Any:
    """The extension built for ``isa``, or ``None`` where it cannot be built here."""
    from phloem.runtime.layers.cpu_build import build_extension

    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", *_ISA_FLAGS[isa]]
    return build_extension(f"phloem_qdot_{isa}", "qdot_kernels.cpp", flags)


_chosen: list[Any] = []  # [module or None] once decided (read at every matmul, so kept cheap)


def _load_kernels() -> Any:
    """The fastest extension this CPU runs, or ``None`` (switched off, no AVX2, no compiler)."""
    if _chosen:
        return _chosen[0]
    kernels = None
    if not switches.DISABLE_QUANT_KERNELS.flag():
        for isa in supported_isas():
            kernels = build_kernels(isa)
            if kernels is not None:
                break
    _chosen.append(kernels)
    return kernels


def kernels_isa() -> str | None:
    """``"avx512vnni"`` or ``"avx2"``: the kernel built for this CPU; ``None`` if none can be."""
    kernels = _load_kernels()
    return None if kernels is None else str(kernels.isa)


# ---- reference ----------------------------------------------------------------------------------
def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` float32 -> ``xq`` float32 integers ``[M, G, 32]``, ``dx [M, G]``, ``sx [M, G]``."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = (blocks * inv[..., None]).round().clamp(-127, 127)
    return q, d, d * q.sum(-1)


def reference_matmul(
    x: torch.Tensor, q: torch.Tensor, dw: torch.Tensor, mw: torch.Tensor | None
) -> torch.Tensor:
    """The kernels' computation in torch: ``x [M, K]`` float32, integer quants ``q [N, K]``,
    float32 scales ``dw`` (and minimums ``mw`` for Q4_1) ``[N, K/32]`` -> float32 ``[M, N]``.

    Block sums in float64 (exact: integers far below 2**53), then the float32 steps in the
    kernel's order, block by block."""
    n, k = q.shape
    xq, dx, sx = quantize_activations_ref(x)  # [M, G, 32]
    qb = q.reshape(n, k // BLOCK, BLOCK).double().permute(1, 2, 0)  # [G, 32, N]
    isum = torch.bmm(xq.double().permute(1, 0, 2), qb).float()  # [G, M, N], exact
    y = torch.zeros(x.shape[0], n)
    for g in range(k // BLOCK):
        y = y + isum[g] * (dw[:, g][None, :] * dx[:, g][:, None])
        if mw is not None:
            y = y + mw[:, g][None, :] * sx[:, g][:, None]
    return y


# ---- packing ------------------------------------------------------------------------------------
def _tiles(n: int) -> tuple[int, int]:
    t = -(-n // TILE)
    return t, t * TILE - n


def _half_bytes(s: torch.Tensor, t: int, pad: int) -> torch.Tensor:
    """Float32 scales ``[N, G]`` (float16-exact) -> their float16 bytes per tile ``[T, G, 16]``."""
    if not torch.equal(s.half().float(), s):
        raise ValueError("block scales must be float16 values (as GGUF stores them)")
    g = s.shape[1]
    h = F.pad(s, (0, 0, 0, pad)).half().reshape(t, TILE, g).permute(0, 2, 1).contiguous()
    return h.view(torch.uint8)  # [T, G, 16]


def pack_q4(w: Q4Weight) -> torch.Tensor:
    """Q4_1 blocks -> ``uint8 [T, G, 160]`` (the layout is described in ``qdot_kernels.h``)."""
    n, k = w.shape
    g = k // BLOCK
    t, pad = _tiles(n)
    qs = w.qs.reshape(n, g, BLOCK // 2)
    q = torch.cat((qs & 15, qs >> 4), dim=-1)  # [N, G, 32] in element order
    q = F.pad(q, (0, 0, 0, 0, 0, pad)).reshape(t, TILE, g, 2, 4, 4)  # [T, r, G, half, p, e]
    q = q.permute(0, 2, 3, 4, 1, 5)  # [T, G, half, p, r, e]
    quants = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(t, g, 128)
    return torch.cat((quants, _half_bytes(w.d, t, pad), _half_bytes(w.m, t, pad)), dim=-1).contiguous()


def pack_q8(w: Q8Weight) -> torch.Tensor:
    """Q8_0 blocks -> ``uint8 [T, G, 272]`` (the layout is described in ``qdot_kernels.h``)."""
    n, k = w.shape
    g = k // BLOCK
    t, pad = _tiles(n)
    q = F.pad(w.qs.reshape(n, g, BLOCK), (0, 0, 0, 0, 0, pad)).reshape(t, TILE, g, 8, 4)  # [T, r, G, c, e]
    quants = q.permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8).reshape(t, g, 256)
    return torch.cat((quants, _half_bytes(w.d, t, pad)), dim=-1).contiguous()


def _unpack_scales(raw: torch.Tensor, n: int) -> torch.Tensor:
    t, g = raw.shape[:2]
    return raw.contiguous().view(torch.float16).float().permute(0, 2, 1).reshape(t * TILE, g)[:n]


def unpack_q4(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_q4`: quants ``[N, K]`` (int64, 0..15), ``dw``, ``mw`` ``[N, G]``."""
    t, g, _ = packed.shape
    b = packed[..., :128].reshape(t, g, 4, TILE, 4)  # [T, G, p, r, e]
    q = torch.stack((b & 15, b >> 4), dim=2)  # [T, G, half, p, r, e]
    q = q.permute(0, 4, 1, 2, 3, 5).reshape(t * TILE, g * BLOCK)[:n].long()
    return q, _unpack_scales(packed[..., 128:144], n), _unpack_scales(packed[..., 144:160], n)


def unpack_q8(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_q8`: quants ``[N, K]`` (int64), ``dw [N, G]``."""
    t, g, _ = packed.shape
    q = packed[..., :256].contiguous().view(torch.int8).reshape(t, g, 8, TILE, 4)  # [T, G, c, r, e]
    q = q.permute(0, 3, 1, 2, 4).reshape(t * TILE, g * BLOCK)[:n].long()
    return q, _unpack_scales(packed[..., 256:272], n)


def q8_blocks_from_float(w: torch.Tensor) -> Q8Weight:
    """Q8_0 blocks with float16 scales (as llama.cpp stores them), for tensors the file has in
    another type; ``q = round(w / d)`` with the rounded scale."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // BLOCK, BLOCK)
    d = (blocks.abs().amax(-1) / 127).half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = (blocks * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
    return Q8Weight(q.reshape(n, k), d)


# ---- layers -------------------------------------------------------------------------------------
class _DotWeight(_QuantWeight):
    packed: torch.Tensor
    dense_min_rows = 0  # one kernel at every row count (it is batch invariant)

    def __init__(self, packed: torch.Tensor, n: int) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        self.n = n

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.packed.shape[1] * BLOCK

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Integer quants ``[N, K]``, scales and (Q4_1) minimums ``[N, K/32]``."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        q, dw, mw = self.parts()
        n, k = q.shape
        w = q.reshape(n, k // BLOCK, BLOCK).float() * dw[..., None]
        if mw is not None:
            w = w + mw[..., None]
        return w.reshape(n, k)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return reference_matmul(x.float(), *self.parts())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K] @ W.T`` -> float32 ``[M, N]`` (int8 activations, see the module docstring)."""
        kernels = _load_kernels()
        if kernels is None:
            return self.reference(x)
        return self._kernel(kernels, x.float())


class Q4DotWeight(_DotWeight):
    """GGUF Q4_1 blocks packed for the integer-dot kernel (:func:`pack_q4`)."""

    @classmethod
    def from_blocks(cls, w: Q4Weight) -> Q4DotWeight:
        return cls(pack_q4(w), w.shape[0])

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return unpack_q4(self.packed, self.n)

    def _kernel(self, kernels: Any, x: torch.Tensor) -> torch.Tensor:
        return kernels.q4_dot(x, self.packed, self.n)


class Q8DotWeight(_DotWeight):
    """GGUF Q8_0 blocks packed for the integer-dot kernel (:func:`pack_q8`)."""

    @classmethod
    def from_blocks(cls, w: Q8Weight) -> Q8DotWeight:
        return cls(pack_q8(w), w.shape[0])

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        q, dw = unpack_q8(self.packed, self.n)
        return q, dw, None

    def _kernel(self, kernels: Any, x: torch.Tensor) -> torch.Tensor:
        return kernels.q8_dot(x, self.packed, self.n)


DotWeight: TypeAlias = Q4DotWeight | Q8DotWeight
Blocks: TypeAlias = Q4Weight | Q8Weight


def _dot_weight(blocks: Blocks) -> DotWeight:
    return (
        Q4DotWeight.from_blocks(blocks) if isinstance(blocks, Q4Weight) else Q8DotWeight.from_blocks(blocks)
    )


def _merged(parts: list[Blocks | None], weight: torch.Tensor, ranges: list[tuple[int, int]]) -> DotWeight:
    """One packed weight for row ranges stacked along the output axis: the file's blocks when every
    part has blocks of one type, else Q8_0 requantized from the float rows."""
    kinds = {type(p) for p in parts}
    if len(kinds) == 1 and None not in parts:
        first = parts[0]
        if isinstance(first, Q4Weight):
            cat = [torch.cat([getattr(p, key) for p in parts]) for key in ("qs", "d", "m")]
            return Q4DotWeight.from_blocks(Q4Weight(*cat))
        cat = [torch.cat([getattr(p, key) for p in parts]) for key in ("qs", "d")]
        return Q8DotWeight.from_blocks(Q8Weight(*cat))
    return Q8DotWeight.from_blocks(q8_blocks_from_float(weight))


def quantize_model_gguf(model: nn.Module, blocks: dict[str, Blocks]) -> None:
    """Replace every :class:`Linear` weight and the LM head by a packed integer-dot weight (in place).

    ``blocks`` maps checkpoint names (``...q_proj.weight``, ``model.embed_tokens.weight``) to the
    GGUF's Q4_1 / Q8_0 blocks, used as they are; a tensor the file holds in another type is
    requantized to Q8_0. The token embedding stays float (it is only gathered).
    """
    from phloem.runtime.layers.embedding import LMHead
    from phloem.runtime.layers.linear import Linear, MergedLinear

    for name, module in model.named_modules():
        if isinstance(module, MergedLinear):
            prefix = name.rsplit(".", 1)[0]
            parts = [blocks.get(f"{prefix}.{part}_proj.weight") for part in module.offsets]
            module.set_quantized(_merged(parts, module.weight.data, list(module.offsets.values())))
        elif isinstance(module, Linear):
            own = blocks.get(f"{name}.weight")
            module.set_quantized(_merged([own], module.weight.data, [(0, module.weight.shape[0])]))
        elif isinstance(module, LMHead):
            key = "model.embed_tokens.weight" if module.tied_to is not None else f"{name}.weight"
            own = blocks.get(key)
            module.set_quantized(_merged([own], module.full_weight.data, [(0, module.full_weight.shape[0])]))
