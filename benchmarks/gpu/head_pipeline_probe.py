"""Decode attention pipelined with its projections by KV-head group: is there time to win?

At 128-256 requests a Llama-3-8B decode layer runs qkv (~21 us), attention (~190 us, bound by
K/V reads) and the output projection (~17 us) one after the other, and the two projections leave
most SMs idle (48-96 tiles on 132 SMs). The three are only coupled per KV head: the attention of
heads ``g`` needs their q (and new k, v) columns of the qkv product, and the output projection is
a sum over head groups. So with ``G`` groups the layer can run as::

    GEMM stream (high priority):  kv | q_0 | q_1 | ... | o_0 | o_1 += ...
    attention stream:                   att_0 | att_1 | ...

with ``q_{g+1}`` beside ``att_g`` and ``o_g`` beside ``att_{g+1}``. This probe times one layer's
chain (qkv -> decode attention with the step's token rotated and stored by the kernel -> o) over
``--layers`` distinct layers (weights and K/V out of L2), serial against pipelined, in CUDA graphs
and eagerly, on the offline run's ragged contexts (``attention_bench.offline_layout``)::

    python3 -m benchmarks.gpu.head_pipeline_probe --batch 128,208,256 --groups 2,4 --out F

``--check`` runs a tiny case on the CPU (Triton interpreter, no streams) and compares the
pipelined chain with the serial one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SHAPES = {"llama3-8b": (4096, 32, 8, 128), "qwen3-0.6b": (1024, 16, 8, 128), "tiny": (128, 4, 2, 64)}


@dataclass
class Layer:
    w_qkv: torch.Tensor  # [(Hq + 2 Hk) D, H]
    w_o: torch.Tensor  # [H, Hq D]
    w_q_groups: list[torch.Tensor]  # rows of w_qkv: group g's query heads
    w_kv: torch.Tensor  # rows of w_qkv: every k then every v head
    w_o_groups: list[torch.Tensor]  # contiguous copies of w_o's columns of group g
    k_buf: torch.Tensor
    v_buf: torch.Tensor


@dataclass
class Batch:
    rtt: torch.Tensor
    rpi: torch.Tensor
    seq_lens: torch.Tensor
    slots: torch.Tensor  # the step's token's slot per request
    cos: torch.Tensor
    sin: torch.Tensor


def build(shape: str, ctx: list[int], layers: int, groups: list[int], device: str):
    from benchmarks.gpu.attention_bench import offline_layout

    hidden, hq, hk, d = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(0)
    bs = len(ctx)
    rtt = offline_layout(ctx).to(device)
    n_slots = int(rtt.max()) + 1

    def rand(*s: int, scale: float = 1.0) -> torch.Tensor:
        # the interpreter's dots are not exact in bfloat16: the CPU check runs in float16
        dtype = torch.bfloat16 if device == "cuda" else torch.float16
        return (torch.randn(*s, generator=gen, device=device) * scale).to(dtype)

    out = []
    for _ in range(layers):
        w_qkv = rand((hq + 2 * hk) * d, hidden, scale=hidden**-0.5)
        w_o = rand(hidden, hq * d, scale=(hq * d) ** -0.5)
        per_groups = {}
        for g_count in groups:  # group g's query rows of w_qkv, its columns of w_o
            qg = hq // g_count * d
            per_groups[g_count] = (
                [w_qkv[g * qg : (g + 1) * qg] for g in range(g_count)],
                [w_o[:, g * qg : (g + 1) * qg].contiguous() for g in range(g_count)],
            )
        k_buf, v_buf = rand(n_slots, hk, d), rand(n_slots, hk, d)
        out.append((w_qkv, w_o, per_groups, k_buf, v_buf))
    pos = torch.tensor([c - 1 for c in ctx], device=device)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    ang = pos[:, None].float() * inv[None, :]
    slots = rtt[torch.arange(bs, device=device), pos]
    batch = Batch(rtt, torch.arange(bs, device=device), torch.tensor(ctx, device=device), slots,
                  ang.cos()[:, None, :], ang.sin()[:, None, :])  # fmt: skip
    x = rand(bs, hidden)
    return out, batch, x


def make_layer(raw, g_count: int) -> Layer:
    w_qkv, w_o, per_groups, k_buf, v_buf = raw
    qg_w, og_w = per_groups[g_count] if g_count > 1 else ([w_qkv], [w_o])
    return Layer(w_qkv, w_o, qg_w, w_qkv[w_o.shape[1] :], og_w, k_buf, v_buf)  # k, v rows follow Hq D


class Chain:
    """The layers' qkv -> attention -> o chain, serial (``groups == 1``) or pipelined."""

    def __init__(self, shape: str, layers: list[Layer], batch: Batch, x: torch.Tensor, groups: int,
                 streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None) -> None:  # fmt: skip
        from phloem.runtime.attention.triton_kernels import decode_scratch

        self.hidden, self.hq, self.hk, self.d = SHAPES[shape]
        self.layers, self.batch, self.x, self.groups, self.streams = layers, batch, x, groups, streams
        bs = x.shape[0]
        self.out = torch.empty(bs, self.hq, self.d, dtype=x.dtype, device=x.device)
        self.scratch = [
            decode_scratch(bs, self.hq // groups, self.hk // groups, self.d, x.device) for _ in range(groups)
        ]
        self.y = torch.empty(bs, self.hidden, dtype=x.dtype, device=x.device)

    def _attend(self, layer: Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: int) -> None:
        from phloem.runtime.attention.triton_kernels import NewTokenKV, decode_attention

        b, hq_g, hk_g = self.batch, self.hq // self.groups, self.hk // self.groups
        heads, kv_heads = slice(g * hq_g, (g + 1) * hq_g), slice(g * hk_g, (g + 1) * hk_g)
        part_o, part_lse = self.scratch[g]
        new_kv = NewTokenKV(k, v, b.cos, b.sin, b.slots)
        decode_attention(
            q, layer.k_buf[:, kv_heads], layer.v_buf[:, kv_heads], self.out[:, heads], part_o, part_lse,
            req_to_token=b.rtt, req_pool_indices=b.rpi, seq_lens=b.seq_lens, sm_scale=self.d**-0.5,
            new_kv=new_kv,
        )  # fmt: skip

    def _serial_layer(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        bs, hq, hk, d = x.shape[0], self.hq, self.hk, self.d
        qkv = F.linear(x, layer.w_qkv)
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        self._attend(layer, q.view(bs, hq, d), k.view(bs, hk, d), v.view(bs, hk, d), 0)
        return F.linear(self.out.view(bs, -1), layer.w_o)

    def _pipelined_layer(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        bs, g_count, d = x.shape[0], self.groups, self.d
        hq_g, hk_g = self.hq // g_count, self.hk // g_count
        gemm, att = self.streams if self.streams is not None else (None, None)
        kv = F.linear(x, layer.w_kv)  # [B, 2 Hk D]: every head's new k, then v
        self._keep.append(kv)
        k_all, v_all = kv.view(bs, 2, self.hk, d).unbind(1)
        ready = []
        for g in range(g_count):
            q = F.linear(x, layer.w_q_groups[g]).view(bs, hq_g, d)
            self._keep.append(q)
            kv_heads = slice(g * hk_g, (g + 1) * hk_g)
            if att is None:
                self._attend(layer, q, k_all[:, kv_heads], v_all[:, kv_heads], g)
                continue
            ev = torch.cuda.Event()
            ev.record(gemm)
            with torch.cuda.stream(att):
                att.wait_event(ev)
                self._attend(layer, q, k_all[:, kv_heads], v_all[:, kv_heads], g)
                done = torch.cuda.Event()
                done.record(att)
                ready.append(done)
        y = None
        for g in range(g_count):
            if ready:
                gemm.wait_event(ready[g])
            a = self.out.view(bs, -1)[:, g * hq_g * d : (g + 1) * hq_g * d]  # row stride Hq D
            y = F.linear(a, layer.w_o_groups[g]) if y is None else y.addmm_(a, layer.w_o_groups[g].t())
        assert y is not None
        return y

    def run(self) -> torch.Tensor:
        """The chain on the current stream (its GEMMs on the first of ``streams``, if given)."""
        cur = torch.cuda.current_stream() if self.streams is not None else None
        gemm, att = self.streams if self.streams is not None else (None, None)
        self._keep: list[torch.Tensor] = []  # held to the end: the attention stream reads them
        if gemm is not None and att is not None and cur is not None:
            if cur != gemm:
                gemm.wait_stream(cur)
            att.wait_stream(gemm)
        with torch.cuda.stream(gemm) if gemm is not None else contextlib.nullcontext():
            x = self.x
            for layer in self.layers:
                x = self._serial_layer(layer, x) if self.groups == 1 else self._pipelined_layer(layer, x)
                x = x * 0.5  # keep activations bounded; one small kernel a layer in every variant
            self.y.copy_(x)
        if gemm is not None and att is not None and cur is not None:
            gemm.wait_stream(att)
            if cur != gemm:
                cur.wait_stream(gemm)
        self._keep = []
        return self.y


def time_chain(chain: Chain, graph: bool, reps: int = 20) -> float:
    """Median ms of one run of the chain (all its layers), replayed from a CUDA graph or eager."""
    capture = chain.streams[0] if chain.streams is not None else torch.cuda.Stream()
    for _ in range(3):
        chain.run()
    torch.cuda.synchronize()
    g = None
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=capture):
            chain.run()
        torch.cuda.synchronize()
    return median_ms(g.replay if g is not None else chain.run, reps)


def median_ms(run: Callable[[], object], reps: int) -> float:
    """Median ms of ``reps`` timed calls of ``run`` (after a warm-up)."""
    from benchmarks.gpu.gemm_shapes import time_call

    return time_call(run, reps) / 1e3


def time_parts(chain: Chain, reps: int = 20) -> tuple[float, float]:
    """(GEMMs only, attention only) ms over the layers, serial, in graphs."""
    bs, hq, hk, d = chain.x.shape[0], chain.hq, chain.hk, chain.d

    def gemms() -> None:
        x = chain.x
        for layer in chain.layers:
            F.linear(x, layer.w_qkv)
            x = F.linear(chain.out.view(bs, -1), layer.w_o) * 0.5

    qkv = [F.linear(chain.x, layer.w_qkv) for layer in chain.layers]

    def attention() -> None:
        for layer, t in zip(chain.layers, qkv):
            q, k, v = t.split([hq * d, hk * d, hk * d], dim=-1)
            chain._attend(layer, q.view(bs, hq, d), k.view(bs, hk, d), v.view(bs, hk, d), 0)

    res = []
    for fn in (gemms, attention):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        res.append(median_ms(g.replay, reps))
    return res[0], res[1]


def check() -> int:
    """CPU, interpreter: the pipelined chain equals the serial one (to bf16 rounding of the
    split-K sum of the output projection) on a tiny shape."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    ctx = [5, 9, 17, 3]
    for groups in (2,):
        ys = []
        for g in (1, groups):
            raw2, batch2, x2 = build("tiny", ctx, 2, [groups], "cpu")  # fresh pools: the kernel writes them
            chain = Chain("tiny", [make_layer(r, g) for r in raw2], batch2, x2, g, None)
            ys.append(chain.run().float())
        diff = (ys[0] - ys[1]).abs().max().item()
        scale = ys[0].abs().max().item()
        print(f"groups={groups}: max diff {diff:.3g} of {scale:.3g}")
        if not diff <= 0.02 * scale:
            return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--batch", default="128,208,256")
    ap.add_argument("--groups", default="2,4")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ctx-range", default="100:1600", help="contexts uniform in [lo, hi]")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.check:
        return check()
    lo, hi = (int(v) for v in args.ctx_range.split(":"))
    groups = [int(g) for g in args.groups.split(",")]
    hi_prio = torch.cuda.Stream(priority=-1)
    lo_prio = torch.cuda.Stream(priority=0)
    same = torch.cuda.Stream(priority=0)
    rows = []
    for bs in (int(b) for b in args.batch.split(",")):
        ctx = torch.randint(lo, hi + 1, (bs,), generator=torch.Generator().manual_seed(bs)).tolist()
        raw, batch, x = build(args.shape, ctx, args.layers, groups, "cuda")
        serial = Chain(args.shape, [make_layer(r, 1) for r in raw], batch, x, 1, None)
        gemm_ms, att_ms = time_parts(serial)
        cases = [("serial", 1, None)]
        for g in groups:
            cases += [(f"G={g} prio", g, (hi_prio, lo_prio)), (f"G={g} flat", g, (same, lo_prio))]
        ref = serial.run().float().clone()
        for rep in range(2):
            for name, g, streams in cases:
                chain = (
                    serial
                    if g == 1
                    else Chain(args.shape, [make_layer(r, g) for r in raw], batch, x, g, streams)
                )
                row = {"shape": args.shape, "batch": bs, "mean_context": round(sum(ctx) / bs), "case": name,
                       "groups": g, "rep": rep, "layers": args.layers}  # fmt: skip
                for graph in (True, False):
                    ms = time_chain(chain, graph)
                    row["graph_us_per_layer" if graph else "eager_us_per_layer"] = round(
                        ms * 1e3 / args.layers, 2
                    )
                y = chain.run().float()
                row["max_diff"] = round((y - ref).abs().max().item(), 4)
                row["gemm_only_us"] = round(gemm_ms * 1e3 / args.layers, 2)
                row["attention_only_us"] = round(att_ms * 1e3 / args.layers, 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
