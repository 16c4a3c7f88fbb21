"""What the one-row projection loops compile to for Hopper, on this machine: no GPU needed.

Archived: it ran as ``benchmarks/gpu/row_loop_regs.py`` on code with the loop options of
``a/loop_options.patch`` (not in the tree: they lost everywhere); to run it again, apply the patch
and copy it back to ``benchmarks/gpu/``.

The one-row kernels (``_norm_row_kernel`` in ``runtime/layers/row_fused.py``, the one-row path of
``_skinny_kernel`` in ``runtime/layers/skinny_gemm.py``) stream a weight along K in chunks. Each
setting (block sizes, and the ``defer`` / ``prefetch`` loop options of ``SkinnyConfig``) is
compiled here for ``sm_90a`` with the specialization the launcher gets at run time (pointers,
sizes and strides divisible by 16), and reported with:

- registers per thread and bytes spilled (``ptxas -v``);
- programs resident per SM by registers (65,536 a SM, allocated per warp in units of 256) and
  threads, and how many waves the grid of a given weight takes on 132 SMs;
- inside the K loop: barriers (``bar.sync``), shared-memory stores, and 16-byte weight loads.
  A barrier in the loop holds every warp of the program until the slowest one's chunk has
  arrived, so no warp requests its next chunk early.

Usage (repository root)::

    python -m benchmarks.gpu.row_loop_regs [--shape llama3-8b] [--json F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.gpu.skinny_bench import SHAPES

SMS = 132
OPTIONS = [(False, False), (True, False), (False, True), (True, True)]
# projection -> (fused GLU or not or skinny, settings (block_n, block_k, warps))
SETTINGS = {
    "qkv": ("norm", [(4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4)]),
    "gate_up": ("glu", [(2, 256, 4), (2, 512, 4), (2, 1024, 4), (4, 256, 4)]),
    "o": ("skinny", [(4, 512, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 8)]),
    "down": ("skinny", [(8, 256, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4)]),
}


def _compile(fn, consts: dict, sig: dict, warps: int) -> tuple[str, str]:  # noqa: ANN001
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    aligned = [
        n for n in sig if n.endswith("_ptr") or n in ("N", "K", "HALF", "stride_wn", "stride_xm", "stride_ym")
    ]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(
        fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts, attrs=attrs
    )
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3}
    )
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", str(path), "-o",
                              str(path.with_suffix(".cubin"))], capture_output=True, text=True, check=True)  # fmt: skip
    return ptx, out.stdout + out.stderr


def _loop_body(ptx: str) -> str:
    """The PTX of the K loop: from the first block LLVM marks as in (or heading) a loop to the
    loop's exit block."""
    lines = ptx.splitlines()
    start = next(
        (i for i, ln in enumerate(lines) if ln.startswith("$L__BB") and ("Loop" in ln or ".lr.ph" in ln)),
        None,
    )
    if start is None:
        return ""
    end = next(
        (i for i in range(start, len(lines)) if lines[i].startswith("$L__BB") and "crit_edge" in lines[i]),
        len(lines),
    )
    return "\n".join(lines[start:end])


def resident(regs: int, warps: int) -> int:
    per_warp = -(-regs * 32 // 256) * 256
    return max(0, min(32, 64 // warps, 65536 // (per_warp * warps)))


def report(shape: str, dtype: str = "bf16") -> list[dict]:
    from phloem.runtime.layers.row_fused import _norm_row_kernel
    from phloem.runtime.layers.skinny_gemm import _skinny_kernel

    ptr = f"*{dtype}"
    norm_sig = {n: ptr for n in ("x_ptr", "res_ptr", "h_ptr", "g_ptr", "w_ptr", "b_ptr", "y_ptr")}
    norm_sig |= {n: "i32" for n in ("N", "K", "HALF", "stride_wn")} | {"eps": "fp32"}
    skinny_sig = {n: ptr for n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr")}
    skinny_sig |= {n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn", "stride_ym")}
    rows = []
    for proj, (kind, settings) in SETTINGS.items():
        n, k = SHAPES[shape][proj]
        for (bn, bk, warps), (defer, prefetch) in itertools.product(settings, OPTIONS):
            if kind == "skinny":
                consts = dict(HAS_BIAS=False, ONE_ROW=True, UPCAST=False, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk,
                              DEFER=defer, PREFETCH=prefetch, PDL=True)  # fmt: skip
                ptx, log = _compile(_skinny_kernel, consts, skinny_sig, warps)
                programs = -(-n // bn)
            else:
                consts = dict(HAS_RES=True, HAS_BIAS=False, GLU=kind == "glu", BLOCK_N=bn, BLOCK_K=bk,
                              DEFER=defer, PREFETCH=prefetch, PDL=True)  # fmt: skip
                ptx, log = _compile(_norm_row_kernel, consts, norm_sig, warps)
                programs = -(-(n // 2 if kind == "glu" else n) // bn)
            regs = int(log.split("Used ")[1].split(" registers")[0])
            per_sm = resident(regs, warps)
            body = _loop_body(ptx)
            rows.append({
                "proj": proj, "n": n, "k": k, "block_n": bn, "block_k": bk, "warps": warps,
                "defer": defer, "prefetch": prefetch, "registers": regs,
                "spill_store_bytes": int(log.split("bytes spill stores")[0].split(",")[-1].strip()),
                "programs": programs, "resident_per_sm": per_sm,
                "waves": round(programs / max(1, per_sm * SMS), 2),
                "loop_barriers": body.count("bar.sync"), "loop_shared_stores": len(re.findall(r"st\.shared", body)),
                "loop_16B_loads": len(re.findall(r"ld\.global(\.\w+)*\.v4\.b32", body)),
            })  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    rows = report(args.shape)
    cols = ["proj", "block_n", "block_k", "warps", "defer", "prefetch", "registers", "spill_store_bytes",
            "resident_per_sm", "waves", "loop_barriers", "loop_shared_stores", "loop_16B_loads"]  # fmt: skip
    print(" ".join(f"{c[:10]:>10}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]!s:>10}" for c in cols))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
