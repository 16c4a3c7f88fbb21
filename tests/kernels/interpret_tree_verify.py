"""The tree-verify kernel's small cases under Triton's CPU interpreter; run as a script (the
interpreter must be on before ``triton`` is imported: ``test_tree_verify_triton.py``)."""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from tests.kernels.verify_cases import HEADS, SMALL_CASES, compare  # noqa: E402


def main() -> int:
    failures = 0
    for case in SMALL_CASES:
        for heads in HEADS:
            for dtype in (torch.float32, torch.float16):  # bf16 dots are wrong under the interpreter
                try:
                    print(f"ok   {case} {heads} {dtype} rel_err={compare(case, heads, dtype, 'cpu'):.2e}")
                except AssertionError as exc:
                    failures += 1
                    print(f"FAIL {exc}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
