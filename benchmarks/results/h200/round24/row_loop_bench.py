"""One-row decode projections: how each program's loop over K is written, on a CUDA device.

Archived: it ran as ``benchmarks/gpu/row_loop_bench.py`` on code with the loop options of
``a/loop_options.patch`` (not in the tree: they lost everywhere); to run it again, apply the patch
and copy it back to ``benchmarks/gpu/``.

A batch-1 decode step of a large model is a chain of one-row projections, each a stream over its
weight: the norm-folded qkv and gate/up (``runtime/layers/row_fused.py``) and the plain o, down
and LM head (``runtime/layers/skinny_gemm.py``). Two options of their loops are timed here over
a grid of block sizes, PDL on (as in a captured step):

- ``defer``: the products accumulate per element and are summed once after the loop, instead of
  every chunk summing across the program's warps;
- ``prefetch``: the next chunk of W is requested before this one is used, so two are in flight.

Then a layer chain (qkv, o, gate/up, down, each on its own copy of the layer's weights, 32
layers a graph) with each projection's default setting, and with the fastest setting of each
option family. Weights are read from HBM (copies cycled past L2, as in ``skinny_bench.py``).
``--baseline`` times only the defaults (single projections and the chain): it runs on code
without the options, for an A/B on one machine.

Usage (repository root, on the GPU machine)::

    python3 -m benchmarks.gpu.row_loop_bench --shape llama3-8b --out $OUT/row_loop.json [--baseline]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu.decode_bench import copy_bandwidth, run_record
from benchmarks.gpu.fused_bench import graph_us
from benchmarks.gpu.skinny_bench import DTYPE, SHAPES, cold_calls, cold_weights

FUSED = {"qkv": False, "gate_up": True}  # projection -> GLU, for the norm-folded ones
# (block_n, block_k, warps) per projection kind; every one with each (defer, prefetch) pair
GRID = {
    "plain": [(2, 512, 4), (4, 256, 4), (4, 512, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4),
              (16, 512, 4), (4, 1024, 4), (8, 1024, 4)],
    "glu": [(2, 256, 4), (2, 512, 4), (2, 1024, 4), (4, 256, 4), (4, 512, 4), (8, 256, 4)],
    "lm_head": [(32, 256, 4), (16, 512, 4), (16, 256, 4), (32, 128, 4)],
}  # fmt: skip
OPTIONS = [(False, False), (True, False), (False, True), (True, True)]
FAMILIES = [f"defer={int(d)},prefetch={int(p)}" for d, p in OPTIONS]
LAYER = ("qkv", "o", "gate_up", "down")
CHAIN_LAYERS = 32
CHAIN_COPIES = 8  # distinct layer weights cycled by the chain (8 x a Llama-3-8B layer: 3.5 GB)


def make_call(name: str, w: torch.Tensor, config: Any) -> Callable[[], torch.Tensor]:
    """One projection of one row on ``w`` with ``config`` (None: the module's default)."""
    from phloem.runtime.layers.row_fused import norm_linear_rows
    from phloem.runtime.layers.skinny_gemm import skinny_linear

    k = w.shape[1]
    x = torch.randn(1, k, device="cuda").to(DTYPE)
    if name in FUSED:
        res = torch.randn(1, k, device="cuda").to(DTYPE)
        g = (1 + 0.1 * torch.randn(k, device="cuda")).to(DTYPE)
        glu = FUSED[name]
        if config is None:
            return lambda: norm_linear_rows(x, res, g, 1e-6, w, glu=glu)[0]
        return lambda: norm_linear_rows(x, res, g, 1e-6, w, glu=glu, config=config)[0]
    if config is None:
        return lambda: skinny_linear(x, w)
    return lambda: skinny_linear(x, w, config=config)


def cycled(name: str, ws: list[torch.Tensor], config: Any) -> Callable[[], torch.Tensor]:
    calls = [make_call(name, w, config) for w in ws]
    state = {"i": 0}

    def step() -> torch.Tensor:
        state["i"] = (state["i"] + 1) % len(calls)
        return calls[state["i"]]()

    return step


def sweep(name: str, ws: list[torch.Tensor], baseline: bool) -> dict:
    from phloem.runtime.layers.skinny_gemm import SkinnyConfig

    calls = cold_calls(ws)
    out: dict = {"default_us": round(graph_us(cycled(name, ws, None), calls=calls), 3)}
    if baseline:
        return out
    kind = "glu" if FUSED.get(name) else "lm_head" if name == "lm_head" else "plain"
    timed = []
    for (bn, bk, nw), (defer, prefetch) in itertools.product(GRID[kind], OPTIONS):
        cfg = SkinnyConfig(bn, bk, nw, 3, defer, prefetch)
        try:
            us = graph_us(cycled(name, ws, cfg), calls=calls, reps=10)
        except Exception as exc:  # out of registers or shared memory for this tile
            print(f"skip {name} {cfg}: {type(exc).__name__}", flush=True)
            continue
        timed.append({"us": round(us, 3), **cfg._asdict()})
    timed.sort(key=lambda r: r["us"])
    out["grid"] = timed
    # the fastest of each option family, timed again next to the default (the sweep's reps are few)
    best = {}
    for defer, prefetch in OPTIONS:
        fam = [r for r in timed if r["defer"] == defer and r["prefetch"] == prefetch]
        if fam:
            r = fam[0]
            cfg = SkinnyConfig(r["block_n"], r["block_k"], r["num_warps"], 3, defer, prefetch)
            best[FAMILIES[OPTIONS.index((defer, prefetch))]] = {
                "config": cfg._asdict(), "us": round(graph_us(cycled(name, ws, cfg), calls=calls, reps=30), 3)
            }  # fmt: skip
    out["default_again_us"] = round(graph_us(cycled(name, ws, None), calls=calls, reps=30), 3)
    out["best_per_family"] = best
    return out


def chain_us(shape: dict, layers: list[dict], configs: dict) -> float:
    """Microseconds per layer of a graph of CHAIN_LAYERS one-row layers (qkv, o, gate/up, down)."""
    steps = []
    for i in range(CHAIN_LAYERS):
        ws = layers[i % len(layers)]
        steps += [make_call(name, ws[name], configs.get(name)) for name in ("qkv", "o", "gate_up", "down")]

    def run() -> None:
        for s in steps:
            s()

    return graph_us(run, calls=1, reps=30) / CHAIN_LAYERS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument(
        "--baseline", action="store_true", help="time the defaults only (code without the options)"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from phloem.runtime.layers.pdl import set_pdl

    set_pdl(True)
    bandwidth = copy_bandwidth()
    shape = SHAPES[args.shape]
    report: dict = {**run_record("row_loop_bench", DTYPE, bandwidth), "shape": args.shape,
                    "floor": "weight bytes / copy bandwidth", "projections": {}}  # fmt: skip
    with torch.inference_mode():
        for name in LAYER:
            project(name, shape, bandwidth, report, args)
        layers = [
            {
                name: (torch.randn(*shape[name], device="cuda") * shape[name][1] ** -0.5).to(DTYPE)
                for name in LAYER
            }
            for _ in range(CHAIN_COPIES)
        ]
        chains = {"default": chain_us(shape, layers, {})}
        if not args.baseline:
            from phloem.runtime.layers.skinny_gemm import SkinnyConfig

            for fam in FAMILIES:
                cfgs = {name: SkinnyConfig(**report["projections"][name]["best_per_family"][fam]["config"])
                        for name in LAYER}  # fmt: skip
                chains[fam] = chain_us(shape, layers, cfgs)
            chains["best"] = chain_us(shape, layers, picks(report))
            chains["default_again"] = chain_us(shape, layers, {})
        del layers
        floor = sum(shape[p][0] * shape[p][1] * 2 for p in LAYER) / bandwidth * 1e6
        report["chain"] = {"layers": CHAIN_LAYERS, "floor_us_per_layer": round(floor, 3),
                           "us_per_layer": {key: round(v, 3) for key, v in chains.items()}}  # fmt: skip
        print(json.dumps(report["chain"]), flush=True)
        write(args.out, report)
        project("lm_head", shape, bandwidth, report, args)
    write(args.out, report)
    return 0


def project(name: str, shape: dict, bandwidth: float, report: dict, args: argparse.Namespace) -> None:
    n, k = shape[name]
    ws = cold_weights(n, k)
    row = {
        "n": n,
        "k": k,
        "floor_us": round(n * k * 2 / bandwidth * 1e6, 3),
        **sweep(name, ws, args.baseline),
    }
    report["projections"][name] = row
    print(json.dumps({key: v for key, v in row.items() if key != "grid"}), flush=True)
    write(args.out, report)  # what is done so far survives a time limit


def picks(report: dict) -> dict:
    """Per projection, the fastest setting of any option family where it beat the default."""
    from phloem.runtime.layers.skinny_gemm import SkinnyConfig

    out = {}
    for name, row in report["projections"].items():
        fams = row.get("best_per_family") or {}
        if fams:
            rec = min(fams.values(), key=lambda r: r["us"])
            if rec["us"] < row["default_again_us"]:
                out[name] = SkinnyConfig(**rec["config"])
    return out


def write(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
