"""The few-row norm + projection kernels (``runtime/layers/row_fused.py``) against torch, on fresh
random inputs: one row (multiply-adds) and 2-16 rows (``tl.dot``).

Shared by ``test_row_fused.py`` (compiled kernel on CUDA) and, run as a script, by Triton's CPU
interpreter (``python -m tests.kernels.row_fused_cases`` with ``TRITON_INTERPRET=1``, in a child
process). The oracle is the unfused math in float32: ``h = x + residual`` rounded as a 16-bit add
rounds it, ``rms_norm`` of ``h`` (not rounded at one row; rounded to 16 bits at 2-16 rows, as the
norm kernel writes it and as that kernel's dot takes it), ``F.linear``, ``silu(gate) * up``; only
the output is rounded. The kernel writes into fresh ``torch.empty`` outputs, so an element it failed to write
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
ROWS = [1, 2, 5, 16, 37, 64]  # one row, the dot path's smallest, a verify of five, full and ragged tiles
SMALL_ROWS = [1, 3, 20]


def reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    g: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    b: torch.Tensor | None,
    glu: bool,
    round_normed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.nn.functional as F

    h = x + residual if residual is not None else x  # rounds like the kernel's add
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * g.float()
    if (
        round_normed
    ):  # the few-row kernel's dot takes the normalized rows in 16 bits, as a norm kernel writes them
        normed = normed.to(x.dtype).float()
    y = F.linear(normed, w.float(), None if b is None else b.float())
    if glu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y.to(x.dtype), h


def check_norm_linear(
    shape: tuple[int, int],
    dtype: torch.dtype,
    device: str,
    seed: int,
    variant: tuple[bool, bool, bool],
    rows: int = 1,
) -> float:
    from phloem.runtime.layers.row_fused import norm_linear_rows

    has_res, has_bias, glu = variant
    gen = torch.Generator(device=device).manual_seed(seed)
    n, k = shape

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device) * scale).to(dtype)

    x, res = randn(rows, k), randn(rows, k, scale=4.0) if has_res else None
    g = (1 + 0.3 * torch.randn(k, generator=gen, device=device)).to(dtype)
    w, b = randn(n, k, scale=k**-0.5), randn(n) if has_bias else None
    eps = 1e-5 if seed % 2 else 1e-6
    before = (x.clone(), None if res is None else res.clone())
    y, h = norm_linear_rows(x, res, g, eps, w, b, glu=glu)
    ref_y, ref_h = reference(x, res, g, eps, w, b, glu, round_normed=rows > 1)
    if rows > 1:  # the two-pass route (K in several chunks) against the same oracle
        from phloem.runtime.layers.skinny_gemm import SkinnyConfig

        y_chunked, _ = norm_linear_rows(x, res, g, eps, w, b, glu=glu, config=SkinnyConfig(16, 32, 4, 1))
        tol = INTERPRETER_BF16_TOL if (_interpreted() and dtype == torch.bfloat16) else REL_TOL[dtype]
        check_close(f"norm_linear {variant} rows={rows} chunked", y_chunked, ref_y, tol)
    if rows > 2:  # the dot path pads to a full tile: a row's result does not depend on the others
        y2, _ = norm_linear_rows(x[:2], None if res is None else res[:2], g, eps, w, b, glu=glu)
        assert torch.equal(y[:2], y2), "rows 0-1 differ between calls of 2 and of all rows"
    assert torch.equal(x, before[0]) and (res is None or torch.equal(res, before[1])), "inputs changed"
    if res is None:
        assert h.data_ptr() == x.data_ptr(), "without a residual the sum is x itself"
    elif dtype != torch.bfloat16 or not _interpreted():  # the interpreter truncates bf16
        assert torch.equal(h, ref_h), "x + residual differs from the plain add"
    tol = INTERPRETER_BF16_TOL if (_interpreted() and dtype == torch.bfloat16) else REL_TOL[dtype]
    return check_close(f"norm_linear {variant} rows={rows}", y, ref_y, tol)


def check_rejects(device: str) -> None:
    from phloem.runtime.layers.row_fused import MAX_ROWS, norm_linear_rows

    w = torch.zeros(8, 32, dtype=torch.float16, device=device)
    g = torch.ones(32, dtype=torch.float16, device=device)
    x = torch.zeros(1, 32, dtype=torch.float16, device=device)
    too_many = MAX_ROWS + 1
    bad = [
        (torch.zeros(too_many, 32, dtype=torch.float16, device=device), None, w, None, False, "x must be"),
        (torch.zeros(0, 32, dtype=torch.float16, device=device), None, w, None, False, "x must be"),
        (torch.zeros(2, 31, dtype=torch.float16, device=device), None, w, None, False, "x must be"),
        (x, torch.zeros(1, 31, dtype=torch.float16, device=device), w, None, False, "residual"),
        (x, None, w.float(), None, False, "dtype"),
        (x, None, w, w[:, 0], True, "glu"),
        (x, None, w[:7], None, True, "glu"),
    ]
    for xx, res, ww, bb, glu, word in bad:
        try:
            norm_linear_rows(xx, res, g, 1e-6, ww, bb, glu=glu)
        except ValueError as exc:
            assert word in str(exc), f"message {exc!r} does not name {word!r}"
        else:
            raise AssertionError(f"no ValueError for a bad call ({word})")


def run_small(device: str = "cpu") -> int:
    """Every small case; prints one line per case, returns the number of failures."""
    checks = [
        (
            f"norm_linear {shape} {variant} rows={rows} {dn}",
            partial(check_norm_linear, shape, dt, device, 3, variant, rows),
        )
        for shape in SMALL_SHAPES
        for variant in VARIANTS
        for rows in SMALL_ROWS
        for dn, dt in DTYPES.items()
    ]
    return run_checks([*checks, ("rejects", partial(check_rejects, device))])


if __name__ == "__main__":
    sys.exit(interpreted_main(run_small))
