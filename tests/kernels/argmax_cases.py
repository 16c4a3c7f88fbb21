"""The two-launch greedy argmax (``runtime/sampling/argmax_triton.py``) against ``torch.argmax``.

Shared by ``test_argmax_triton.py`` (compiled kernels on CUDA) and, run as a script, by Triton's
CPU interpreter (``python -m tests.kernels.argmax_cases`` with ``TRITON_INTERPRET=1``, in a child
process). Every row is fresh random logits; some rows repeat their max at later positions (inside
one chunk and across chunks) to pin the lowest-index tie rule, and one row is all ``-inf``.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from .interpreter import interpreted_main, run_checks

# rows x vocab: SmolLM2 and Llama-3 vocabularies at batch 1, 64 and 256, and ragged widths
SHAPES = [(1, 49152), (64, 49152), (256, 49152), (1, 128256), (64, 128256), (3, 1000), (5, 1)]
# small enough for the interpreter; (100, 5000) puts two blocks in each chunk
SMALL_SHAPES = [(1, 3000), (4, 2500), (3, 700), (2, 1), (100, 5000)]


def check_argmax(shape: tuple[int, int], dtype: torch.dtype, device: str, seed: int) -> None:
    from phloem.runtime.sampling.argmax_triton import argmax_rows

    gen = torch.Generator(device=device).manual_seed(seed)
    rows, vocab = shape
    x = (torch.randn(shape, generator=gen, device=device) * 4).to(dtype)
    for r in range(0, rows, 2):  # ties: the row's max again at later positions
        top = int(x[r].argmax())
        for j in (top + 1, top + 1024, top + vocab // 2, vocab - 1):  # same block, next block, ...
            if top < j < vocab:
                x[r, j] = x[r, top]
    if rows > 2:
        x[rows - 1] = float("-inf")
    out = argmax_rows(x)
    ref = x.argmax(dim=-1)
    assert out.dtype == torch.int64 and out.shape == ref.shape, f"{out.dtype} {out.shape}"
    bad = (out != ref).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:5]}: {out[bad[:5]].tolist()} vs torch {ref[bad[:5]].tolist()}"
    strided = x[:, : max(1, vocab // 2)]  # a view with row stride vocab (a slice of wider logits)
    assert torch.equal(argmax_rows(strided), strided.argmax(dim=-1)), "strided rows"


def run_small(device: str = "cpu") -> int:
    """Every small case; prints one line per case, returns the number of failures."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return run_checks(
        (f"argmax {shape} {dn}", partial(check_argmax, shape, dt, device, 3))
        for shape in SMALL_SHAPES
        for dn, dt in dtypes.items()
    )


if __name__ == "__main__":
    sys.exit(interpreted_main(run_small))
