"""The rows matmul kernel (``runtime/layers/rows_gemm.py``) against ``F.linear`` on fresh random
inputs.

Shared by ``test_rows_gemm.py`` (compiled kernel on CUDA) and, run as a script, by Triton's CPU
interpreter (``python -m tests.kernels.rows_gemm_cases`` with ``TRITON_INTERPRET=1``). Output is
fresh ``torch.empty``, so a column or row the kernel failed to write shows up as a mismatch.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from .fused_cases import INTERPRETER_BF16_TOL, REL_TOL, _interpreted, check_close
from .interpreter import interpreted_main, run_checks

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ROWS = [17, 48, 100, 208, 256]  # one chunk, two, three (64 + 32 + 16 for 100), three, one of 256
# (N, K): Llama-3-8B's projections (qkv, o, gate_up, down) and ragged ones
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1000, 700), (33, 4100)]
SMALL_SHAPES = [(40, 200), (96, 128)]  # small enough for the interpreter
SMALL_ROWS = [17, 40]


def check_rows(
    shape: tuple[int, int], rows: int, dtype: torch.dtype, device: str, seed: int, config=None
) -> float:
    """Plain, strided-input and 3-D-input calls of ``rows`` rows against ``F.linear`` in float32
    rounded to ``dtype``; the same call twice (the split-K counters must have been left at zero);
    returns the worst relative error."""
    import torch.nn.functional as F
    from phloem.runtime.layers.rows_gemm import rows_linear

    gen = torch.Generator(device=device).manual_seed(seed)
    n, k = shape

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device) * scale).to(dtype)

    w = randn(n, k, scale=k**-0.5)
    wide = randn(rows, k + 24)
    x = wide[:, 5 : 5 + k]  # row stride k + 24: a view, as a slice of a fused projection is
    tol = INTERPRETER_BF16_TOL if _interpreted() and dtype == torch.bfloat16 else REL_TOL[dtype]

    def ref(xx: torch.Tensor) -> torch.Tensor:
        return F.linear(xx.float(), w.float()).to(dtype)

    first = rows_linear(x, w, config=config)
    errs = [check_close("plain", first, ref(x), tol)]
    again = rows_linear(x, w, config=config)
    assert torch.equal(first, again), "a second identical call differs (split-K counters not reset?)"
    if rows % 2 == 0:
        x3 = x.contiguous().view(2, rows // 2, k)
        errs.append(check_close("3-d input", rows_linear(x3, w, config=config), ref(x3), tol))
    return max(errs)


def check_row_chunks() -> None:
    from phloem.runtime.layers.rows_gemm import MAX_ROWS, row_chunks

    for m in range(1, MAX_ROWS + 1):
        chunks = row_chunks(m)
        assert len(chunks) == 4 and list(chunks) == sorted(chunks, reverse=True), (m, chunks)
        used = [c for c in chunks if c]
        assert all(c >= 16 and c & (c - 1) == 0 for c in used), (m, chunks)
        assert m <= sum(used) < m + 16, (m, chunks)  # padded to the next multiple of 16, no more
    assert row_chunks(208) == (128, 64, 16, 0)
    for bad in (0, MAX_ROWS + 1):
        try:
            row_chunks(bad)
        except ValueError:
            continue
        raise AssertionError(f"row_chunks({bad}) did not raise")


def check_rejects(device: str) -> None:
    from phloem.runtime.layers.rows_gemm import MAX_ROWS, rows_linear

    w = torch.zeros(8, 32, dtype=torch.float16, device=device)
    bad = [
        (torch.zeros(MAX_ROWS + 1, 32, dtype=torch.float16, device=device), w, "rows"),
        (torch.zeros(20, 31, dtype=torch.float16, device=device), w, "width"),
        (torch.zeros(20, 32, device=device), w.float(), "float16 / bfloat16"),
        (torch.zeros(20, 32, dtype=torch.float16, device=device), w.t().contiguous().t(), "contiguous"),
    ]
    for x, weight, word in bad:
        try:
            rows_linear(x, weight)
        except ValueError as exc:
            assert word in str(exc), f"message {exc!r} does not name {word!r}"
        else:
            raise AssertionError(f"no ValueError for a bad call ({word})")


def run_small(device: str = "cpu") -> int:
    """Every small case, with one split and with several; prints one line per case, returns the
    number of failures."""
    from phloem.runtime.layers.rows_gemm import RowsConfig

    configs = {"split1": RowsConfig(32, 32, 1, 4, 2), "split3": RowsConfig(16, 32, 3, 4, 2)}
    checks = [
        (f"rows {shape} rows={rows} {dn} {cn}", partial(check_rows, shape, rows, dt, device, 3, cfg))
        for shape in SMALL_SHAPES
        for rows in SMALL_ROWS
        for dn, dt in DTYPES.items()
        for cn, cfg in configs.items()
    ]
    return run_checks([*checks, ("chunks", check_row_chunks), ("rejects", partial(check_rejects, device))])


if __name__ == "__main__":
    sys.exit(interpreted_main(run_small))
