"""The draft head's attention over its dense cache through the split-KV decode kernel
(``runtime/speculative/draft_attention.py``) against its torch reference.

Shared by ``test_draft_attention.py`` (compiled kernel on CUDA) and, run as a script, by Triton's
CPU interpreter (``python -m tests.kernels.draft_attention_cases``, in a child process). Each case
is a fresh random cache of ``R`` rows x ``L`` entries; rows are picked in any order (one twice),
every query has its own key count from 1 to ``L`` (one query sees one key, one the whole row). A
key read past a query's count, or a key of another row, changes the output well past the
tolerance.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from .interpreter import interpreted_main, run_checks

# (queries per row M, picked rows, cache rows R, length L, q heads, kv heads, head dim)
SHAPES = [
    (1, [2, 0, 5, 2], 6, 1024, 9, 3, 64),  # a chain level of SmolLM2's head, batch 4
    (5, [1], 4, 2048, 9, 3, 64),  # a catch-up after a 4-draft chain, batch 1
    (5, [3, 0, 1, 2, 4, 6, 7, 5], 8, 512, 32, 8, 128),  # Llama-3-8B's head shape, batch 8
]
SMALL_SHAPES = [(1, [2, 0, 2], 3, 40, 6, 2, 16), (4, [1, 0], 2, 70, 4, 4, 32)]


def check_draft_attention(shape: tuple[int, list[int], int, int, int, int, int], dtype: torch.dtype, device: str,
                          seed: int) -> float:  # fmt: skip
    from phloem.runtime.speculative.draft_attention import attend_kernel, attend_reference
    from phloem.runtime.speculative.eagle import _slot_table

    m, picked, r, n, hq, hk, d = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn((r, n, hk, d), generator=gen, device=device).to(dtype)
    v = torch.randn((r, n, hk, d), generator=gen, device=device).to(dtype)
    rows = torch.tensor(picked, device=device)
    b = rows.numel()
    limits = torch.randint(1, n + 1, (b, m), generator=gen, device=device)
    limits[0, 0] = 1  # one key only
    limits[-1, -1] = n  # the whole row
    q = torch.randn((b, m, hq + 3, d), generator=gen, device=device).to(dtype)[:, :, :hq]  # strided heads
    ref = attend_reference(q.float(), k.float(), v.float(), rows, limits, n)
    out = attend_kernel(q, k, v, _slot_table(r, n, torch.device(device)), rows, limits)
    assert out.shape == ref.shape and out.dtype == dtype, f"{out.shape} {out.dtype}"
    err = float((out.float() - ref).abs().max() / ref.abs().max())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert err < tol, f"relative error {err:.2e}"
    return err


def run_small(device: str = "cpu") -> int:
    # bfloat16 is left to the GPU: the interpreter's dot gives garbage for bf16 operands
    dtypes = {"fp32": torch.float32, "fp16": torch.float16}
    return run_checks(
        (f"draft attention {shape[:2]} {dn}", partial(check_draft_attention, shape, dt, device, 5))
        for shape in SMALL_SHAPES
        for dn, dt in dtypes.items()
    )


if __name__ == "__main__":
    sys.exit(interpreted_main(run_small))
