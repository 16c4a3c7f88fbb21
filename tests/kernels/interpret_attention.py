"""Run the small attention cases under Triton's CPU interpreter; run as a script.

``TRITON_INTERPRET=1`` must be set before ``triton`` is imported, so this runs in its own process
(see ``test_attention_triton_interpret.py``). Prints one line per case, exits non-zero on failure.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

from tests.kernels.attention_cases import DTYPES, SMALL_BATCHES, SMALL_HEADS, compare_with_ref, make_batch  # noqa: E402


def main() -> int:
    failures = 0
    for batch_name, (prefix, extend, mode) in SMALL_BATCHES.items():
        for heads_name, heads in SMALL_HEADS.items():
            # bf16 is left to the GPU test: the interpreter's tl.dot gives garbage for bf16
            # operands (numpy has no bf16; a bare 16x16 bf16 dot is off by 1e10 under triton 3.9).
            for dtype_name in ("fp32", "fp16"):
                b = make_batch(prefix, extend, mode, heads, dtype=DTYPES[dtype_name], device="cpu", seed=7)
                try:
                    err = compare_with_ref("triton", b, heads.q)
                    print(f"ok   {batch_name} {heads_name} {dtype_name} rel_err={err:.2e}")
                except AssertionError as exc:
                    failures += 1
                    print(f"FAIL {batch_name} {heads_name} {dtype_name}: {exc}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
