"""``benchmarks/gpu/step_profile.py`` with the one-row projections set to the fastest settings a
``row_loop_bench.py`` sweep found (where they beat the default), for an end-to-end A/B before
those settings become the defaults.

    python3 benchmarks/results/h200/round24/patched_step.py SWEEP.json [step_profile arguments]
"""

import json
import runpy
import sys

from phloem.runtime.layers import row_fused, skinny_gemm
from phloem.runtime.layers.skinny_gemm import SkinnyConfig

table = {}
for row in json.load(open(sys.argv[1]))["projections"].values():
    fams = row.get("best_per_family") or {}
    if fams:
        rec = min(fams.values(), key=lambda r: r["us"])
        if rec["us"] < row["default_again_us"]:
            table[(row["n"], row["k"])] = SkinnyConfig(**rec["config"])
print("one-row settings:", {f"{n}x{k}": tuple(c) for (n, k), c in table.items()}, file=sys.stderr)
orig_row, orig_pick = row_fused.row_config, skinny_gemm.pick_config


def row_config(n_rows, k, *, glu, rows=1):  # noqa: ANN001, ANN201
    return (
        table[(n_rows, k)] if rows == 1 and (n_rows, k) in table else orig_row(n_rows, k, glu=glu, rows=rows)
    )


def pick_config(n, k, rows):  # noqa: ANN001, ANN201
    return table[(n, k)] if rows == 1 and (n, k) in table else orig_pick(n, k, rows)


row_fused.row_config, skinny_gemm.pick_config = row_config, pick_config
sys.argv = ["benchmarks/gpu/step_profile.py", *sys.argv[2:]]
runpy.run_path("benchmarks/gpu/step_profile.py", run_name="__main__")
