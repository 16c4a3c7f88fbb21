"""The one-row norm + projection kernel (``runtime/layers/row_fused.py``) against torch, on fresh
random inputs.

Shared by ``test_row_fused.py`` (compiled kernel on CUDA) and, run as a script, by Triton's CPU
interpreter (``python -m tests.kernels.row_fused_cases`` with ``TRITON_INTERPRET=1``, in a child
process). The oracle is the unfused math in float32: ``h = x + residual`` rounded as a 16-bit add
rounds it, ``rms_norm`` of ``h`` (not rounded), ``F.linear``, ``silu(gate) * up``; only the output
is rounded. The kernel writes into fresh ``torch.empty`` outputs, so an element it failed to write
shows up as a mismatch.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from .fused_cases import INTERPRETER_BF16_TOL, REL_TOL, _interpreted, check_close
from .interpreter import interpreted_main, run_checks

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (N, K) of the stacked weight: SmolLM2-135M qkv and gate/up, Llama-3-8B qkv and gate/up, ragged
SHAPES = [(960, 576), (3072, 576), (6144, 4096), (28672, 4096), (1002, 700)]
SMALL_SHAPES = [(40, 70), (96, 128), (18, 300)]  # small enough for the interpreter
# (residual, bias, glu): the first layer's qkv, later layers' qkv, Qwen2's biased qkv, gate/up
VARIANTS = [(False, False, False), (True, False, False), (True, True, False), (True, False, True)]


def reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    g: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    b: torch.Tensor | None,
    glu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.nn.functional as F

    h = x + residual if residual is not None else x  # rounds like the kernel's add
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * g.float()
    y = F.linear(normed, w.float(), None if b is None else b.float())
    if glu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y.to(x.dtype), h


def check_norm_linear(
    shape: tuple[int, int], dtype: torch.dtype, device: str, seed: int, variant: tuple[bool, bool, bool]
) -> float:
    from phloem.runtime.layers.row_fused import norm_linear_row

    has_res, has_bias, glu = variant
    gen = torch.Generator(device=device).manual_seed(seed)
    n, k = shape

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device) * scale).to(dtype)

    x, res = randn(1, k), randn(1, k, scale=4.0) if has_res else None
    g = (1 + 0.3 * torch.randn(k, generator=gen, device=device)).to(dtype)
    w, b = randn(n, k, scale=k**-0.5), randn(n) if has_bias else None
    eps = 1e-5 if seed % 2 else 1e-6
    before = (x.clone(), None if res is None else res.clone())
    y, h = norm_linear_row(x, res, g, eps, w, b, glu=glu)
    ref_y, ref_h = reference(x, res, g, eps, w, b, glu)
    assert torch.equal(x, before[0]) and (res is None or torch.equal(res, before[1])), "inputs changed"
    if res is None:
        assert h.data_ptr() == x.data_ptr(), "without a residual the sum is x itself"
    elif dtype != torch.bfloat16 or not _interpreted():  # the interpreter truncates bf16
        assert torch.equal(h, ref_h), "x + residual differs from the plain add"
    tol = INTERPRETER_BF16_TOL if (_interpreted() and dtype == torch.bfloat16) else REL_TOL[dtype]
    return check_close(f"norm_linear {variant}", y, ref_y, tol)


def check_rejects(device: str) -> None:
    from phloem.runtime.layers.row_fused import norm_linear_row

    w = torch.zeros(8, 32, dtype=torch.float16, device=device)
    g = torch.ones(32, dtype=torch.float16, device=device)
    x = torch.zeros(1, 32, dtype=torch.float16, device=device)
    bad = [
        (torch.zeros(2, 32, dtype=torch.float16, device=device), None, w, None, False, "x must be"),
        (x, torch.zeros(1, 31, dtype=torch.float16, device=device), w, None, False, "residual"),
        (x, None, w.float(), None, False, "dtype"),
        (x, None, w, w[:, 0], True, "glu"),
        (x, None, w[:7], None, True, "glu"),
    ]
    for xx, res, ww, bb, glu, word in bad:
        try:
            norm_linear_row(xx, res, g, 1e-6, ww, bb, glu=glu)
        except ValueError as exc:
            assert word in str(exc), f"message {exc!r} does not name {word!r}"
        else:
            raise AssertionError(f"no ValueError for a bad call ({word})")


def run_small(device: str = "cpu") -> int:
    """Every small case; prints one line per case, returns the number of failures."""
    checks = [
        (f"norm_linear {shape} {variant} {dn}", partial(check_norm_linear, shape, dt, device, 3, variant))
        for shape in SMALL_SHAPES
        for variant in VARIANTS
        for dn, dt in DTYPES.items()
    ]
    return run_checks([*checks, ("rejects", partial(check_rejects, device))])


if __name__ == "__main__":
    sys.exit(interpreted_main(run_small))
