"""Registers and spills of the few-row norm + projection kernel (``runtime/layers/row_fused.py``)
for Hopper, compiled on this machine: no GPU needed.

Triton compiles the kernel for ``sm_90`` here; ``ptxas -v`` (the one Triton's NVIDIA backend uses)
then reports registers per thread and bytes spilled to local memory for each setting. A program
that needs 255 registers at eight warps takes a whole SM's register file, and spills go through
local memory; both matter for a kernel that is meant to be bound by latency, not bytes.

Usage (repository root)::

    python -m benchmarks.gpu.row_fused_regs [--dtype bf16]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

# (GLU, BLOCK_N, BLOCK_K, warps): the routed settings (one chunk of 1,024) and smaller tiles
SETTINGS = [(False, 16, 1024, 8), (False, 32, 1024, 8), (True, 16, 1024, 8), (True, 32, 1024, 8),
            (True, 32, 1024, 4), (True, 32, 256, 4), (False, 32, 256, 4)]  # fmt: skip


def report(dtype: str) -> list[dict]:
    import triton
    from phloem.runtime.layers.row_fused import _norm_rows_kernel
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    ptxas = get_ptxas(90).path
    ptr, i32 = f"*{dtype}", "i32"
    sig = {name: ptr for name in ("x_ptr", "res_ptr", "h_ptr", "g_ptr", "w_ptr", "b_ptr", "y_ptr")}
    sig |= {name: i32 for name in ("M", "N", "K", "HALF", "stride_xm", "stride_rm", "stride_ym", "stride_wn")}
    sig["eps"] = "fp32"
    rows = []
    for glu, bn, bk, warps in SETTINGS:
        consts = dict(HAS_RES=True, HAS_BIAS=False, GLU=glu, UPCAST=False, SINGLE=bk >= 1024, BLOCK_M=16,
                      BLOCK_N=bn, BLOCK_K=bk, PDL=True)  # fmt: skip
        src = ASTSource(
            fn=_norm_rows_kernel, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts
        )
        kernel = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3}
        )
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / "k.ptx"
            ptx.write_text(kernel.asm["ptx"])
            out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                                 capture_output=True, text=True, check=True)  # fmt: skip
        text = out.stdout + out.stderr
        regs = int(text.split("Used ")[1].split(" registers")[0])
        spill = int(text.split("bytes spill stores")[0].split(",")[-1].strip())
        rows.append({"glu": glu, "block_n": bn, "block_k": bk, "warps": warps, "registers": regs,
                     "spill_store_bytes": spill, "shared_bytes": kernel.metadata.shared})  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = ap.parse_args()
    print(f"{'glu':>5} {'BLOCK_N':>7} {'BLOCK_K':>7} {'warps':>5} {'regs':>5} {'spilled B':>9} {'smem B':>7}")
    for r in report(args.dtype):
        print(f"{r['glu']!s:>5} {r['block_n']:>7} {r['block_k']:>7} {r['warps']:>5} {r['registers']:>5} "
              f"{r['spill_store_bytes']:>9} {r['shared_bytes']:>7}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
