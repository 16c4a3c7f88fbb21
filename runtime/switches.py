"""Every environment switch the runtime reads, declared once; the only reader of ``PHLOEM_*``.

Each :class:`Switch` has a name, a type, a default and a one-line meaning (``docs/config.md``
lists them all). :meth:`Switch.read` looks at the environment each time it is called; callers read
a switch when they build an object or on their first call, never at import, so setting a variable
after ``import phloem.runtime`` still takes effect for the next engine. Modules that cache the
value keep a setter (``fusion.set_fused_kernels``, ``pdl.set_pdl``, ...) for tests and callers.

Booleans follow their default: a switch that is off by default is on only for ``1``; one that is
on by default is off only for ``0``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["SWITCHES", "Switch"]


@dataclass(frozen=True)
class Switch:
    name: str
    kind: type  # bool, int or str
    default: bool | int | str
    meaning: str
    choices: tuple[str, ...] = ()

    def read(self) -> bool | int | str:
        """The switch's current value, typed; a malformed value raises ``ValueError``."""
        text = os.environ.get(self.name)
        if text is None or (self.kind is str and text == "" and not self.choices):
            return self.default
        if self.kind is bool:
            return text != "0" if self.default else text == "1"
        if self.kind is int:
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"{self.name} must be an integer, got {text!r}") from None
        if self.choices and text not in self.choices:  # a typo must not pick a path unnoticed
            raise ValueError(f"{self.name} must be one of {self.choices}, got {text!r}")
        return text

    def flag(self) -> bool:
        value = self.read()
        assert isinstance(value, bool)
        return value

    def number(self) -> int:
        value = self.read()
        assert isinstance(value, int)
        return value

    def text(self) -> str:
        value = self.read()
        assert isinstance(value, str)
        return value


# ---- kernels and layers
DISABLE_FUSED_KERNELS = Switch(
    "PHLOEM_DISABLE_FUSED_KERNELS", bool, False, "turn every fused Triton kernel off (CUDA)"
)
DISABLE_SKINNY_GEMM = Switch(
    "PHLOEM_DISABLE_SKINNY_GEMM", bool, False, "few-row CUDA projections use the GEMM library, not the skinny kernel"
)
DISABLE_ROW_FUSION = Switch(
    "PHLOEM_DISABLE_ROW_FUSION", bool, False, "keep norms (and SiLU x mul) apart from few-row projections"
)
ROW_FUSION_MAX_K = Switch("PHLOEM_ROW_FUSION_MAX_K", int, 768, "longest row (K) a norm folds into a projection for")
ROW_FUSION_MAX_ROWS = Switch(
    "PHLOEM_ROW_FUSION_MAX_ROWS", int, 16, "most rows a norm folds into a projection for (capped at 256)"
)
DISABLE_CPU_WEIGHT_MAJOR = Switch(
    "PHLOEM_DISABLE_CPU_WEIGHT_MAJOR", bool, False, "CPU float32 matmuls of 12-32 rows use torch's order"
)
DISABLE_QUANT_KERNELS = Switch(
    "PHLOEM_DISABLE_QUANT_KERNELS", bool, False, "quantized CPU layers dequantize then matmul (no C++ build)"
)
DISABLE_CPU_DECODE_KERNEL = Switch(
    "PHLOEM_DISABLE_CPU_DECODE_KERNEL", bool, False, "CPU decode attention takes the torch reference path"
)
DISABLE_CPU_DECODE_STEP = Switch(
    "PHLOEM_DISABLE_CPU_DECODE_STEP", bool, False, "CPU decode runs layer by layer in Python, not in one C++ call"
)
PDL = Switch("PHLOEM_PDL", bool, True, "programmatic dependent launch for decode kernels (Hopper and later)")
# ---- attention
DECODE_ROPE = Switch("PHLOEM_DECODE_ROPE", bool, True, "the decode attention kernel applies RoPE and writes new K/V")
DECODE_PREFETCH_PAIRS = Switch(
    "PHLOEM_DECODE_PREFETCH_PAIRS", int, 132, "decode kernels prefetch below this many (request, KV head) pairs"
)
DECODE_ORDER = Switch(
    "PHLOEM_DECODE_ORDER", str, "heads", "decode grid order: requests first for `requests`, else KV heads first"
)
EXTEND_KERNEL = Switch(
    "PHLOEM_EXTEND_KERNEL", str, "contiguous", "prefill attention: the contiguous (TMA) kernel or the pool kernel",
    choices=("contiguous", "pool"),
)  # fmt: skip
# ---- decode
DECODE_EARLY_EXIT = Switch(
    "PHLOEM_DECODE_EARLY_EXIT", bool, False,
    "CUDA graphs skip continuous decode steps once every row sampled a stop token (needs torch's conditional nodes)",
)  # fmt: skip
# ---- jump-forward (--enable-jump-forward)
JUMP_FORWARD_DEVICE_SPELLING = Switch(
    "PHLOEM_JUMP_FORWARD_DEVICE_SPELLING", bool, False,
    "device grammar masks allow only the first token of forced text's own tokenization",
)  # fmt: skip
JUMP_FORWARD_OVERLAP = Switch(
    "PHLOEM_JUMP_FORWARD_OVERLAP", bool, False,
    "overlap batches that may jump (a jump throws its launch in flight away), not process them at once",
)  # fmt: skip
JUMP_EXTEND_OVERLAP = Switch(
    "PHLOEM_JUMP_EXTEND_OVERLAP", bool, False,
    "overlap the extend passes of batches that may jump; a row jumps only once no launch of it is in flight",
)  # fmt: skip
JUMP_CHAIN = Switch(
    "PHLOEM_JUMP_CHAIN", int, -1,
    "nodes a row in chain decode launches: forced tokens taken on the device, W - 1 a step "
    "(0: off, host jumps; -1: 8 on CUDA, off elsewhere)",
)  # fmt: skip
JUMP_LEAD = Switch(
    "PHLOEM_JUMP_LEAD", bool, False,
    "extend a jump's forced tokens in the first pass of the next continuous decode launch, not a pass of their own",
)  # fmt: skip
# ---- files and diagnosis
CACHE_DIR = Switch("PHLOEM_CACHE_DIR", str, "", "where downloaded models go (empty: ~/.cache/phloem)")
LOOP_TRACE = Switch("PHLOEM_LOOP_TRACE", str, "", "write one line per busy scheduler iteration to this file")
# ---- Triton's own switch, read here so the runtime has one reader of the environment
TRITON_INTERPRET = Switch("TRITON_INTERPRET", bool, False, "Triton runs kernels in its CPU interpreter")

SWITCHES: tuple[Switch, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Switch))
