"""cuBLASLt's candidate algorithms on the decode step's projections: its first pick against its best.

    python3 -m benchmarks.gpu.gemm_algos --shape llama3-8b --rows 64,128,160,208,240,256 --out $OUT/algos.json
    python3 -m benchmarks.gpu.gemm_algos --shape llama3-8b --rows 128,160,208,240 --wide --reps 10 --out $OUT/w.json

torch's ``F.linear`` runs whatever cuBLAS picks, or with cuBLASLt preferred the first result of
cuBLASLt's heuristic. This script asks cuBLASLt (through ctypes, the library torch already loaded)
for up to ``--candidates`` algorithms per (projection, row count), checks each one's output
against ``F.linear``, and times each in a CUDA graph of back-to-back calls cycling over enough
weight copies to overflow the L2 cache, so weights come from HBM as they do in a decode step. It
answers one question before anything is built: is the best candidate far enough ahead of torch's
pick, at the row counts decode runs, to be worth a per-shape algorithm table in the model's
linear layers (captured in the decode graphs)?

``--wide`` searches further: the heuristic's lists for neighbouring row counts and every split-K
variant (with each reduction scheme the algorithm supports) of every candidate, each re-checked on
the real shape with ``cublasLtMatmulAlgoCheck`` before it runs.

Layout: ``out[M, N] = x[M, K] @ w[N, K]^T`` is, column-major, ``out^T (N x M) = w^T^T (N x K) @
x^T (K x M)``: A is ``w`` seen as a K x N column-major matrix used transposed, B is ``x`` seen as
K x M, C and D are N x M with leading dimension N.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gpu.gemm_rows import graph_time_us, parse_rows

# cublasLt.h / library_types.h values
_CUDA_R_32F, _CUDA_R_16BF = 0, 14
_CUBLAS_COMPUTE_32F = 68
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_CAP_SPLITK_SUPPORT, _CAP_REDUCTION_SCHEME_MASK = 0, 1
_CONFIG_ID, _CONFIG_TILE_ID, _CONFIG_SPLITK_NUM, _CONFIG_REDUCTION_SCHEME = 0, 1, 2, 3
_CONFIG_STAGES_ID = 6
_REDUCTION_SCHEMES = (1, 2, 4)  # in place, in the compute type's workspace, in the output type's
_OP_N, _OP_T = 0, 1
_WORKSPACE_BYTES = 32 << 20
_L2_BYTES = 50 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def _load_cublaslt() -> ctypes.CDLL:
    """The cuBLASLt library torch loaded (one cuBLASLt matmul through torch makes sure it is)."""
    torch.backends.cuda.preferred_blas_library("cublaslt")
    a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    torch.backends.cuda.preferred_blas_library("cublas")
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcublasLt" in line}
    return ctypes.CDLL(sorted(paths)[0] if paths else "libcublasLt.so")


class CublasLt:
    """The few cuBLASLt calls this probe needs: plan a (M, N, K) bf16 GEMM, list its candidate
    algorithms, run one on the current stream (capturable: the workspace is ours)."""

    def __init__(self) -> None:
        self.lib = _load_cublaslt()
        vp, ptr_vp, size = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t
        signatures = {
            "cublasLtCreate": [ptr_vp],
            "cublasLtMatmulDescCreate": [ptr_vp, ctypes.c_int, ctypes.c_int],
            "cublasLtMatmulDescSetAttribute": [vp, ctypes.c_int, vp, size],
            "cublasLtMatrixLayoutCreate": [ptr_vp, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatmulPreferenceCreate": [ptr_vp],
            "cublasLtMatmulPreferenceSetAttribute": [vp, ctypes.c_int, vp, size],
            "cublasLtMatmulAlgoGetHeuristic": [vp] * 7 + [ctypes.c_int, ctypes.POINTER(_Heuristic),
                                                          ctypes.POINTER(ctypes.c_int)],
            # handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace, size, stream
            "cublasLtMatmul": [vp] * 12 + [ctypes.POINTER(_Algo), vp, size, vp],
            "cublasLtMatmulAlgoCheck": [vp] * 6 + [ctypes.POINTER(_Algo), ctypes.POINTER(_Heuristic)],
            "cublasLtMatmulAlgoCapGetAttribute": [ctypes.POINTER(_Algo), ctypes.c_int, vp, size, ctypes.POINTER(size)],
            "cublasLtMatmulAlgoConfigSetAttribute": [ctypes.POINTER(_Algo), ctypes.c_int, vp, size],
            "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), ctypes.c_int, vp, size, ctypes.POINTER(size)],
        }  # fmt: skip
        for name, args in signatures.items():
            fn = getattr(self.lib, name)
            fn.restype, fn.argtypes = ctypes.c_int, args
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)  # host scalars, read at launch

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def plan(self, m: int, n: int, k: int, count: int) -> tuple[dict[str, ctypes.c_void_p], list[_Heuristic]]:
        lib, byref, addr = self.lib, ctypes.byref, ctypes.addressof
        desc = ctypes.c_void_p()
        self._check(lib.cublasLtMatmulDescCreate(byref(desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F), "desc")
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            val = ctypes.c_int32(op)
            self._check(
                lib.cublasLtMatmulDescSetAttribute(desc, attr, addr(val), ctypes.sizeof(val)), "trans"
            )
        layouts = {}
        for name, rows, cols in (("a", k, n), ("b", k, m), ("c", n, m)):
            lay = ctypes.c_void_p()
            self._check(lib.cublasLtMatrixLayoutCreate(byref(lay), _CUDA_R_16BF, rows, cols, rows), name)
            layouts[name] = lay
        pref = ctypes.c_void_p()
        self._check(lib.cublasLtMatmulPreferenceCreate(byref(pref)), "preference")
        ws = ctypes.c_uint64(_WORKSPACE_BYTES)
        self._check(
            lib.cublasLtMatmulPreferenceSetAttribute(
                pref, _PREF_MAX_WORKSPACE_BYTES, addr(ws), ctypes.sizeof(ws)
            ),
            "workspace",
        )
        results = (_Heuristic * count)()
        got = ctypes.c_int(0)
        self._check(
            lib.cublasLtMatmulAlgoGetHeuristic(
                self.handle, desc, layouts["a"], layouts["b"], layouts["c"], layouts["c"], pref, count, results,
                byref(got),
            ),
            "heuristic",
        )  # fmt: skip
        return {"desc": desc, **layouts}, [results[i] for i in range(got.value) if results[i].state == 0]

    def matmul(self, plan: dict[str, ctypes.c_void_p], algo: _Heuristic, x: torch.Tensor, w: torch.Tensor,
               out: torch.Tensor) -> torch.Tensor:  # fmt: skip
        addr = ctypes.addressof
        self._check(
            self.lib.cublasLtMatmul(
                self.handle, plan["desc"], addr(self._alpha), w.data_ptr(), plan["a"], x.data_ptr(), plan["b"],
                addr(self._beta), out.data_ptr(), plan["c"], out.data_ptr(), plan["c"], ctypes.byref(algo.algo),
                self.workspace.data_ptr(), _WORKSPACE_BYTES, torch.cuda.current_stream().cuda_stream,
            ),
            "cublasLtMatmul",
        )  # fmt: skip
        return out

    def check(self, plan: dict[str, ctypes.c_void_p], algo: _Algo) -> _Heuristic | None:
        """``algo`` re-checked on ``plan``'s shape (its workspace filled in), or None if it cannot run it."""
        result = _Heuristic()
        status = self.lib.cublasLtMatmulAlgoCheck(self.handle, plan["desc"], plan["a"], plan["b"], plan["c"],
                                                  plan["c"], ctypes.byref(algo), ctypes.byref(result))  # fmt: skip
        if status != 0 or result.state != 0 or result.workspace_size > _WORKSPACE_BYTES:
            return None
        result.algo = algo
        return result

    def config(self, algo: _Algo, attr: int) -> int:
        val, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
        self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.addressof(val),
                                                      ctypes.sizeof(val), ctypes.byref(written))  # fmt: skip
        return val.value

    def split_variants(self, algo: _Algo, splits: tuple[int, ...]) -> list[_Algo]:
        """Copies of ``algo`` with each split-K count and reduction scheme it supports."""
        support, mask, written = ctypes.c_int32(0), ctypes.c_uint32(0), ctypes.c_size_t(0)
        cap = self.lib.cublasLtMatmulAlgoCapGetAttribute
        cap(ctypes.byref(algo), _CAP_SPLITK_SUPPORT, ctypes.addressof(support), 4, ctypes.byref(written))
        if not support.value:
            return []
        cap(ctypes.byref(algo), _CAP_REDUCTION_SCHEME_MASK, ctypes.addressof(mask), 4, ctypes.byref(written))
        out = []
        for s in splits:
            for scheme in (0,) if s == 1 else [r for r in _REDUCTION_SCHEMES if mask.value & r]:
                copy = _Algo.from_buffer_copy(algo)
                for attr, value in ((_CONFIG_SPLITK_NUM, s), (_CONFIG_REDUCTION_SCHEME, scheme)):
                    v = ctypes.c_uint32(value)
                    self.lib.cublasLtMatmulAlgoConfigSetAttribute(
                        ctypes.byref(copy), attr, ctypes.addressof(v), 4
                    )
                out.append(copy)
        return out

    def candidates(self, m: int, n: int, k: int, count: int, wide: bool) -> tuple[dict[str, ctypes.c_void_p],
                                                                                list[tuple[str, _Heuristic]]]:  # fmt: skip
        """The heuristic's list for (m, n, k); with ``wide`` also the lists it gives for neighbouring row
        counts and every split-K variant of each, all re-checked on (m, n, k), duplicates dropped."""
        plan, first = self.plan(m, n, k, count)
        found: list[tuple[str, _Heuristic]] = [(f"h{i}", h) for i, h in enumerate(first)]
        if not wide:
            return plan, found
        seen = {bytes(h.algo) for _, h in found}

        def add(tag: str, algo: _Algo) -> None:
            key = bytes(algo)
            if key in seen:
                return
            seen.add(key)
            checked = self.check(plan, algo)
            if checked is not None:
                found.append((tag, checked))

        for other in sorted({max(8, m // 2), max(8, m - 64), m + 32, m + 64, 256, 512} - {m}):
            _, hs = self.plan(other, n, k, count)
            for i, h in enumerate(hs):
                add(f"m{other}h{i}", _Algo.from_buffer_copy(h.algo))
        for tag, h in list(found):
            for variant in self.split_variants(h.algo, (1, 2, 3, 4, 6, 8)):
                add(f"{tag}s{self.config(variant, _CONFIG_SPLITK_NUM)}r{self.config(variant, _CONFIG_REDUCTION_SCHEME)}",
                    variant)  # fmt: skip
        return plan, found

    def describe(self, algo: _Algo) -> dict[str, int]:
        return {name: self.config(algo, attr) for name, attr in (("id", _CONFIG_ID), ("tile", _CONFIG_TILE_ID),
                ("splits", _CONFIG_SPLITK_NUM), ("reduction", _CONFIG_REDUCTION_SCHEME),
                ("stages", _CONFIG_STAGES_ID))}  # fmt: skip


def _cycle(calls: list[Any]) -> Any:
    """One callable that runs the next of ``calls`` each time (a graph then cycles the copies)."""
    state = {"i": 0}

    def run() -> Any:
        fn = calls[state["i"] % len(calls)]
        state["i"] += 1
        return fn()

    return run


def probe(shape: str, rows: list[int], candidates: int, reps: int, wide: bool = False,
          partial: str | None = None, wanted: list[str] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    from benchmarks.gpu.gemm_shapes import projections

    lt = CublasLt()
    out_rows = []
    for name, (n, k) in projections(shape).items():
        if name == "lm_head" or (wanted and name not in wanted):
            continue
        copies = max(2, math.ceil(2 * _L2_BYTES / (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
            ref = F.linear(x, ws[0]).float()
            row: dict[str, Any] = {
                "shape": shape,
                "projection": name,
                "n": n,
                "k": k,
                "rows": m,
                "copies": copies,
            }
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                row[f"torch_{lib}_us"] = graph_time_us(
                    _cycle([lambda w=w, x=x: F.linear(x, w) for w in ws]), reps
                )
            torch.backends.cuda.preferred_blas_library("cublas")
            plan, tagged = lt.candidates(m, n, k, candidates, wide)
            times = []
            for i, (tag, algo) in enumerate(tagged):
                got = lt.matmul(plan, algo, x, ws[0], outs[0]).float()
                err = float((got - ref).abs().max() / ref.abs().max())
                if err > 2e-2:
                    times.append({"index": i, "tag": tag, "error": err})
                    continue
                calls = [
                    lambda w=w, o=o, a=algo, p=plan, x=x: lt.matmul(p, a, x, w, o) for w, o in zip(ws, outs)
                ]
                times.append({"index": i, "tag": tag, "us": graph_time_us(_cycle(calls), reps),
                              "waves": algo.waves_count, "workspace": algo.workspace_size,
                              **lt.describe(algo.algo)})  # fmt: skip
            timed = [t for t in times if "us" in t]
            row["candidates"] = times
            if timed:
                best = min(timed, key=lambda t: t["us"])
                torch_best = min(row["torch_cublas_us"], row["torch_cublaslt_us"])
                row.update(first_us=timed[0]["us"] if timed[0]["index"] == 0 else None, best_us=best["us"],
                           best_index=best["index"], best_tag=best["tag"],
                           best_over_torch=round(best["us"] / torch_best, 3))  # fmt: skip
            out_rows.append(row)
            print(f"{shape} {name:8} M={m:4d}: cublas {row['torch_cublas_us']:6.1f}  cublaslt "
                  f"{row['torch_cublaslt_us']:6.1f}  first {row.get('first_us') or float('nan'):6.1f}  best "
                  f"{row.get('best_us', float('nan')):6.1f} ({row.get('best_tag')}, {len(timed)} of "
                  f"{len(tagged)} ran)  best/torch {row.get('best_over_torch')}", flush=True)  # fmt: skip
            if partial:
                with open(partial, "w") as f:
                    json.dump(out_rows, f)
    return out_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--rows", default="64,128,160,208,240,256")
    p.add_argument("--candidates", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--wide",
        action="store_true",
        help="also the heuristic's picks for neighbouring row counts and split-K variants of each",
    )
    p.add_argument("--projections", default="qkv,o,gate_up,down")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    results = probe(args.shape, parse_rows(args.rows), args.candidates, args.reps, args.wide,
                    args.out + ".partial", args.projections.split(","))  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"benchmark": "gemm_algos", "shape": args.shape, "reps": args.reps, "wide": args.wide,
                   "results": results}, f, indent=1)  # fmt: skip
    if os.path.exists(args.out + ".partial"):
        os.remove(args.out + ".partial")  # the complete file supersedes it


if __name__ == "__main__":
    main()
