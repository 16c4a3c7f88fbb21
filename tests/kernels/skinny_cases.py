"""The skinny matmul kernel (``runtime/layers/skinny_gemm.py``) against ``F.linear`` on fresh
random inputs.

Shared by ``test_skinny_gemm.py`` (compiled kernel on CUDA) and, run as a script, by Triton's CPU
interpreter (``python -m tests.kernels.skinny_cases`` with ``TRITON_INTERPRET=1``, in a child
process because the switch must be set before Triton is imported). The kernel writes into fresh
``torch.empty`` output, so a column it failed to write shows up as a mismatch, not as a pass.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from .fused_cases import INTERPRETER_BF16_TOL, REL_TOL, _interpreted, check_close
from .interpreter import interpreted_main, run_checks

FLOAT32_OUT_TOL = 1e-4
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ROWS = [1, 2, 5, 16]
# (N, K): the projections of SmolLM2-135M (qkv, o, gate_up, down, LM head), Llama-3-8B and ragged
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576),
          (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1000, 700), (33, 4100)]  # fmt: skip
SMALL_SHAPES = [(40, 70), (96, 128), (17, 300)]  # small enough for the interpreter


def _check(name: str, out: torch.Tensor, ref: torch.Tensor) -> float:
    if _interpreted() and ref.dtype in (torch.bfloat16, torch.float32):
        tol = INTERPRETER_BF16_TOL
    elif ref.dtype == torch.float32:  # unrounded sums of up to 14k products, in another order
        tol = FLOAT32_OUT_TOL
    else:
        tol = REL_TOL[ref.dtype]
    return check_close(name, out, ref, tol)


def check_skinny(shape: tuple[int, int], rows: int, dtype: torch.dtype, device: str, seed: int) -> float:
    """Plain, biased, float32-output, strided-input and 3-D-input calls of ``rows`` rows against
    ``F.linear`` in float32 rounded as the call rounds; returns the worst relative error."""
    import torch.nn.functional as F
    from phloem.runtime.layers.skinny_gemm import skinny_linear

    gen = torch.Generator(device=device).manual_seed(seed)
    n, k = shape

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device) * scale).to(dtype)

    w, b = randn(n, k, scale=k**-0.5), randn(n)
    wide = randn(rows, k + 24)
    x = wide[:, 7 : 7 + k]  # row stride k + 24: a view, as a slice of a fused projection is

    def ref(xx: torch.Tensor, bias: torch.Tensor | None, out: torch.dtype) -> torch.Tensor:
        return F.linear(xx.float(), w.float(), None if bias is None else bias.float()).to(out)

    errs = [
        _check("plain", skinny_linear(x, w), ref(x, None, dtype)),
        _check("bias", skinny_linear(x, w, b), ref(x, b, dtype)),
        _check("float32 out", skinny_linear(x, w, out_dtype=torch.float32), ref(x, None, torch.float32)),
    ]
    if rows % 2 == 0:
        x3 = x.contiguous().view(2, rows // 2, k)
        errs.append(_check("3-d input", skinny_linear(x3, w), ref(x3, None, dtype)))
    if rows > 1:  # a row's result does not depend on how many rows share the call (dot path)
        full = skinny_linear(x, w)
        part = skinny_linear(x[:2], w)
        assert torch.equal(full[:2], part), "rows 0-1 differ between calls of 2 and of all rows"
    return max(errs)


def check_rejects(device: str) -> None:
    from phloem.runtime.layers.skinny_gemm import MAX_ROWS, skinny_linear

    w = torch.zeros(8, 32, dtype=torch.float16, device=device)
    bad = [
        (torch.zeros(MAX_ROWS + 1, 32, dtype=torch.float16, device=device), w, "rows"),
        (torch.zeros(1, 31, dtype=torch.float16, device=device), w, "width"),
        (torch.zeros(1, 32, device=device), w.float(), "float16 / bfloat16"),
        (torch.zeros(1, 32, dtype=torch.float16, device=device), w.t().contiguous().t(), "contiguous"),
    ]
    for x, weight, word in bad:
        try:
            skinny_linear(x, weight)
        except ValueError as exc:
            assert word in str(exc), f"message {exc!r} does not name {word!r}"
        else:
            raise AssertionError(f"no ValueError for a bad call ({word})")


def run_small(device: str = "cpu") -> int:
    """Every small case; prints one line per case, returns the number of failures."""
    checks = [
        (f"skinny {shape} rows={rows} {dn}", partial(check_skinny, shape, rows, dt, device, 3))
        for shape in SMALL_SHAPES
        for rows in ROWS
        for dn, dt in DTYPES.items()
    ]
    return run_checks([*checks, ("rejects", partial(check_rejects, device))])


if __name__ == "__main__":
    sys.exit(interpreted_main(run_small))
