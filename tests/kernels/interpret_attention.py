"""Run the small attention cases under Triton's CPU interpreter; run as a script.

``TRITON_INTERPRET=1`` must be set before ``triton`` is imported, so this runs in its own process
(see ``test_attention_triton_interpret.py``). Prints one line per case, exits non-zero on failure.
``--fp8``: the same cases over an fp8 KV pool with non-unit scales (``test_triton_fp8.py``).

Each interpreted decode case takes seconds (every split of the grid is a Python loop), so the
CPU run covers each variable once rather than every combination; the compiled tests on CUDA
(``test_attention_triton.py``, ``test_triton_fp8.py``) run the full tables.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from phloem.runtime.attention import triton_extend_contig  # noqa: E402
from phloem.runtime.forward_io import ForwardMode  # noqa: E402

from tests.kernels.attention_cases import (  # noqa: E402
    DTYPES,
    INTERPRETED_FP8_SCALES,
    INTERPRETED_NEW_KV,
    INTERPRETED_VIEW_TILES,
    SMALL_BATCHES,
    SMALL_HEADS,
    check_contiguous_extend_on_views,
    check_decode_new_kv,
    compare_with_ref,
    make_batch,
)
from tests.kernels.interpreter import shard_of  # noqa: E402

# decode contexts (before the new token) putting it alone, last in a 64-key block, first in one
DECODE_EDGES = [0, 63, 17, 64, 90]


def main(fp8: bool = False, mine: Callable[[], bool] = lambda: True) -> int:
    """Every case in a fixed order; ``mine()`` says whether this process runs the next one."""
    failures = 0
    fp8_pools = {f"fp8_{k}": (torch.float8_e4m3fn, s) for k, s in INTERPRETED_FP8_SCALES.items()}
    pools = fp8_pools if fp8 else {"": (None, None)}
    for batch_name, (prefix, extend, mode) in SMALL_BATCHES.items():
        for heads_name, heads in SMALL_HEADS.items():
            # bf16 is left to the GPU test: the interpreter's tl.dot gives garbage for bf16
            # operands (numpy has no bf16; a bare 16x16 bf16 dot is off by 1e10 under triton 3.9).
            for dtype_name in ("fp32", "fp16"):
                for pool_name, (kv_dtype, scales) in pools.items():
                    # extend runs each kernel: through the pool, and (16-bit pools) the new keys
                    # read from k, v (``triton_extend_contig``)
                    contig = mode == ForwardMode.EXTEND and dtype_name == "fp16" and kv_dtype is None
                    for kernel in ("pool", "contiguous") if contig else ("pool",):
                        if not mine():
                            continue
                        label = kernel if mode == ForwardMode.EXTEND else ""
                        name = " ".join(
                            x for x in (batch_name, heads_name, dtype_name, pool_name, label) if x
                        )
                        b = make_batch(
                            prefix, extend, mode, heads, dtype=DTYPES[dtype_name], device="cpu", seed=7,
                            kv_dtype=kv_dtype, kv_scales=scales,
                        )  # fmt: skip
                        triton_extend_contig.MODE = kernel
                        try:
                            err = compare_with_ref("triton", b, heads.q, extend_kernel=kernel)
                            print(f"ok   {name} rel_err={err:.2e}")
                        except AssertionError as exc:
                            failures += 1
                            print(f"FAIL {name}: {exc}")
    if not fp8:
        for heads_name, heads in SMALL_HEADS.items():
            # the default tiles, the wide ones of prefix-heavy passes, a prefix tile below the new keys'
            for tiles in INTERPRETED_VIEW_TILES:
                if not mine():
                    continue
                name = f"contiguous extend on qkv views {heads_name} tiles {tiles or 'default'}"
                try:
                    err = check_contiguous_extend_on_views(heads, device="cpu", seed=11, tiles=tiles)
                    print(f"ok   {name} rel_err={err:.2e}")
                except AssertionError as exc:
                    failures += 1
                    print(f"FAIL {name}: {exc}")
        # the step's token rotated and stored by the decode kernel, new keys at block edges
        for heads_name, heads in SMALL_HEADS.items():
            for dtype_name, norm in INTERPRETED_NEW_KV:
                if not mine():
                    continue
                name = f"decode new kv {heads_name} {dtype_name}{' qk_norm' if norm else ''}"
                try:
                    err = check_decode_new_kv(
                        DECODE_EDGES, heads, dtype=DTYPES[dtype_name], device="cpu", seed=3, qk_norm=norm
                    )
                    print(f"ok   {name} rel_diff={err:.2e}")
                except AssertionError as exc:
                    failures += 1
                    print(f"FAIL {name}: {exc}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(fp8="--fp8" in sys.argv[1:], mine=shard_of(sys.argv[1:])))
