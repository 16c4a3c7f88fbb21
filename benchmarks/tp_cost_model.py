"""What tensor parallelism should give a decode step on GPUs, before it is measured: a cost model.

    python -m phloem.bench.tp_cost_model --dummy-shape llama3-8b --batch 1 --tp 1,2,4,8 --tp1-tok-s 251.8

A decode step at small batch reads every weight once, so its floor is the weight bytes over the
memory bandwidth. With N ranks each reads 1/N of the weights, and the step gains collectives: an
all-reduce of ``[B, hidden]`` after each layer's attention and MLP and one after the embedding, and
an all-gather of the float32 logits::

    step(N) = decode_weight_bytes / N / (hbm_bw * efficiency)
            + (2 * layers + 1) * allreduce(B * hidden * 2 bytes)
            + allgather(B * vocab * 4 bytes)
    allreduce(m) = latency + 2 (N - 1) / N * m / link_bw      (ring; latency-bound at small m)
    allgather(m) = latency + (N - 1) / N * m / link_bw

``efficiency`` is the fraction of the bandwidth floor one GPU reaches today (from a measured TP=1
figure, ``--tp1-tok-s``, else ``--efficiency``). Every figure this prints is a prediction, not a
measurement; it says which term bounds the speedup (at batch 1 it is the collectives' latency).
It counts weight reads and collectives only: KV-cache reads and compute, which grow with the batch
and the context, are left out, so it is a small-batch model.
Defaults are an H200: 4.8 TB/s HBM, NVLink 450 GB/s per direction.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from phloem.runtime.models.config import ModelConfig

__all__ = ["Prediction", "decode_weight_bytes", "predict"]


@dataclass(frozen=True)
class Prediction:
    tp: int
    weight_ms: float  # reading this rank's weights
    collective_ms: float  # all-reduces and the logits all-gather
    step_ms: float
    tok_s: float  # batch / step
    speedup: float  # over TP=1 of the same model
    floor_fraction: float  # summed-bandwidth floor (weights / (N * hbm_bw)) over step_ms


def decode_weight_bytes(cfg: ModelConfig, bytes_per_weight: int = 2) -> int:
    """Weight bytes one decode step reads: every layer, the final norm and the LM head (the
    embedding table is only gathered, a few rows; a tied head reads it whole as the head)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    attn = h * (cfg.num_heads * d) * 2 + h * (cfg.num_kv_heads * d) * 2  # q, o and k, v
    mlp = 3 * h * i
    layer = attn + mlp + 2 * h  # two norms
    return (cfg.num_layers * layer + h + cfg.vocab_size * h) * bytes_per_weight


def predict(
    cfg: ModelConfig,
    *,
    batch: int,
    tp_sizes: list[int],
    efficiency: float,
    hbm_gbs: float = 4800.0,
    link_gbs: float = 450.0,
    latency_us: float = 10.0,
) -> list[Prediction]:
    weights = decode_weight_bytes(cfg)
    hbm, link, lat = hbm_gbs * 1e9, link_gbs * 1e9, latency_us * 1e-6
    out: list[Prediction] = []
    base_ms = None
    for n in tp_sizes:
        weight_s = weights / n / (hbm * efficiency)
        if n == 1:
            coll_s = 0.0
        else:
            reduce_bytes = batch * cfg.hidden_size * 2
            allreduce = lat + 2 * (n - 1) / n * reduce_bytes / link
            allgather = lat + (n - 1) / n * batch * cfg.vocab_size * 4 / link
            coll_s = (2 * cfg.num_layers + 1) * allreduce + allgather
        step_ms = (weight_s + coll_s) * 1e3
        if base_ms is None:
            base_ms = weights / (hbm * efficiency) * 1e3
        floor_ms = weights / (n * hbm) * 1e3
        out.append(Prediction(
            tp=n, weight_ms=weight_s * 1e3, collective_ms=coll_s * 1e3, step_ms=step_ms,
            tok_s=batch / step_ms * 1e3, speedup=base_ms / step_ms, floor_fraction=floor_ms / step_ms,
        ))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="phloem.bench.tp_cost_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--dummy-shape", default="llama3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tp", default="1,2,4,8", help="comma-separated TP sizes")
    p.add_argument("--tp1-tok-s", type=float, default=None, help="measured TP=1 decode tok/s (sets efficiency)")
    p.add_argument("--efficiency", type=float, default=0.8, help="fraction of the HBM floor reached at TP=1")
    p.add_argument("--hbm-gbs", type=float, default=4800.0)
    p.add_argument("--link-gbs", type=float, default=450.0, help="per direction")
    p.add_argument("--latency-us", type=float, default=10.0, help="one small collective, end to end")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    cfg = ModelConfig.dummy(ns.dummy_shape)
    eff = ns.efficiency
    if ns.tp1_tok_s is not None:
        floor_s = decode_weight_bytes(cfg) / (ns.hbm_gbs * 1e9)
        eff = floor_s / (ns.batch / ns.tp1_tok_s)
    rows = predict(cfg, batch=ns.batch, tp_sizes=[int(x) for x in ns.tp.split(",")], efficiency=eff,
                   hbm_gbs=ns.hbm_gbs, link_gbs=ns.link_gbs, latency_us=ns.latency_us)  # fmt: skip
    if ns.json:
        print(json.dumps({"shape": ns.dummy_shape, "batch": ns.batch, "efficiency": eff,
                          "latency_us": ns.latency_us, "rows": [asdict(r) for r in rows]}))  # fmt: skip
        return 0
    print(f"{ns.dummy_shape}, batch {ns.batch}: {decode_weight_bytes(cfg) / 1e9:.1f} GB read per step, "
          f"TP=1 efficiency {eff:.2f}, collective latency {ns.latency_us:g} us (predictions)")  # fmt: skip
    print(f"{'tp':>3} {'weights ms':>10} {'collect. ms':>11} {'step ms':>8} {'tok/s':>9} {'speedup':>8} {'of floor':>8}")
    for r in rows:
        print(f"{r.tp:>3} {r.weight_ms:>10.2f} {r.collective_ms:>11.2f} {r.step_ms:>8.2f} {r.tok_s:>9.1f} "
              f"{r.speedup:>8.2f} {r.floor_fraction:>8.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
