"""One-batch CPU model benchmark: phloem's ModelRunner vs transformers on the same model.

Loads every engine once, then measures them in interleaved rounds (A B C A B C ...) with the same
thread count and keeps each figure's best round, so a busy shared machine slows all of them alike.
Prints prefill tok/s for a 512-token prompt and decode tok/s at batch 1, 8 and 32 for phloem
(float32, bfloat16, int4, int8, gguf: the CPU default, on the GGUF's own blocks with int8
activations; float32 deterministic) and transformers ``generate`` (float32), each
next to its floor (weight bytes one decode step reads / memory bandwidth, measured with a large
tensor copy) and the ratios. Writes ``benchmarks/results/cpu/cpu_model.json``.

    python benchmarks/cpu_model.py [--threads N] [--decode-steps 16] [--rounds 2] [--skip-hf]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from collections.abc import Callable

import torch
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.model_files import resolve_model

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu", "cpu_model.json")
VARIANTS = {  # row name -> ModelRunner keywords
    "phloem fp32": {"dtype": "float32"},
    "phloem bf16": {"dtype": "bfloat16"},
    "phloem int4": {"dtype": "float32", "quantization": "int4"},
    "phloem int8": {"dtype": "float32", "quantization": "int8"},
    "phloem gguf": {"dtype": "float32", "quantization": "gguf"},
    "phloem gguf ref-attention": {"dtype": "float32", "quantization": "gguf", "attention_backend": "torch_ref"},
    "phloem fp32 deterministic": {"dtype": "float32", "deterministic": True},
}
HF = "transformers fp32"


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """Fastest wall time of ``repeat`` calls (seconds)."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def memory_bandwidth(mib: int = 512, repeat: int = 5) -> float:
    """Bytes/s of a large copy (a copy reads and writes each byte: 2x the tensor size)."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    seconds = best_of(lambda: dst.copy_(src), repeat)
    return 2 * src.numel() * 4 / seconds


def argmax_sampler(logits: torch.Tensor, info: object) -> torch.Tensor:
    return logits.argmax(-1)


def make_prompt(n: int) -> list[int]:
    return [(i * 7919) % 40000 + 100 for i in range(n)]


class PhloemBench:
    def __init__(self, threads: int, **kw: object) -> None:
        self.runner = ModelRunner(resolve_model(None), device="cpu", max_total_tokens=16384,
                                  max_running_requests=40, sampler=argmax_sampler, cpu_threads=threads,
                                  **kw)  # type: ignore[arg-type]  # fmt: skip
        self.batcher = DirectBatcher(self.runner)

    @property
    def decode_weight_bytes(self) -> int:
        return self.runner.decode_weight_bytes

    def prefill(self, prompt: list[int]) -> float:
        b = self.batcher
        b._next_slot = 1  # reuse the pool between measurements
        seq = b.new_sequence()
        t = time.perf_counter()
        b.step({seq: prompt})
        seconds = time.perf_counter() - t
        b.release(seq)
        return seconds

    def decode(self, batch: int, steps: int) -> float:
        """Seconds per decode step of ``batch`` sequences with a 64-token context."""
        b = self.batcher
        b._next_slot = 1
        seqs = [b.new_sequence() for _ in range(batch)]
        b.step({s: make_prompt(64) for s in seqs})
        b.step({s: [42] for s in seqs}, decode=True)  # warm-up
        t = time.perf_counter()
        for _ in range(steps):
            b.step({s: [42] for s in seqs}, decode=True)
        seconds = (time.perf_counter() - t) / steps
        for s in seqs:
            b.release(s)
        return seconds


class HFBench:
    def __init__(self, threads: int) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        path = resolve_model(None).path
        self.model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        ).eval()
        self.decode_weight_bytes = 0

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> float:
        ids = torch.tensor([prompt])
        t = time.perf_counter()
        self.model(ids)
        return time.perf_counter() - t

    @torch.inference_mode()
    def decode(self, batch: int, steps: int) -> float:
        ids = torch.tensor([make_prompt(64)]).repeat(batch, 1)

        def gen(n: int) -> float:
            t = time.perf_counter()
            self.model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
            return time.perf_counter() - t

        return max(gen(steps + 1) - gen(1), 1e-9) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: os.cpu_count())")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best is kept")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated phloem rows")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--label", default="", help="free text stored with the results")
    args = parser.parse_args()
    threads = args.threads or os.cpu_count() or 1

    engines: dict[str, PhloemBench | HFBench] = {
        name: PhloemBench(threads, **VARIANTS[name]) for name in args.variants.split(",") if name
    }
    if not args.skip_hf:
        engines[HF] = HFBench(threads)
    torch.set_num_threads(threads)
    prompt = make_prompt(args.prompt_len)
    best: dict[str, dict[str, float]] = {name: {} for name in engines}
    bandwidth = 0.0
    for _ in range(args.rounds):
        bandwidth = max(bandwidth, memory_bandwidth())
        for name, eng in engines.items():
            eng.prefill(prompt[:32])  # warm-up
            got = {"prefill": eng.prefill(prompt), "b1": eng.decode(1, args.decode_steps),
                   "b8": eng.decode(8, args.decode_steps), "b32": eng.decode(32, args.decode_steps)}  # fmt: skip
            for key, seconds in got.items():
                best[name][key] = min(best[name].get(key, float("inf")), seconds)

    fp32_bytes = engines[next(iter(engines))].decode_weight_bytes if engines else 0
    rows = {}
    for name, eng in engines.items():
        s = best[name]
        step_bytes = eng.decode_weight_bytes or fp32_bytes  # transformers reads the fp32 weights
        floor = step_bytes / bandwidth  # seconds per decode step counting weight reads only
        rows[name] = {
            "prefill_tok_s": args.prompt_len / s["prefill"],
            "decode_b1_tok_s": 1 / s["b1"],
            "decode_b8_tok_s": 8 / s["b8"],
            "decode_b32_tok_s": 32 / s["b32"],
            "itl_b1_ms": 1e3 * s["b1"],
            "decode_weight_bytes": step_bytes,
            "floor_b1_tok_s": 1 / floor,
            "b1_over_floor": floor / s["b1"],
        }
    if HF in rows:
        for r in rows.values():
            r["b1_over_hf"] = r["decode_b1_tok_s"] / rows[HF]["decode_b1_tok_s"]
            r["b8_over_hf"] = r["decode_b8_tok_s"] / rows[HF]["decode_b8_tok_s"]

    load = os.getloadavg()
    print(f"threads={threads} bandwidth={bandwidth / 1e9:.1f} GB/s load average={load[0]:.1f}")
    head = ["prefill tok/s", "b1 ITL ms", "b1 tok/s", "b8 tok/s", "b32 tok/s", "MB/step", "floor b1", "b1/floor",
            "b1/HF", "b8/HF"]  # fmt: skip
    print(f"{'':26s}" + "".join(f"{h:>14s}" for h in head))
    for name, r in rows.items():
        cells = [r["prefill_tok_s"], r["itl_b1_ms"], r["decode_b1_tok_s"], r["decode_b8_tok_s"], r["decode_b32_tok_s"],
                 r["decode_weight_bytes"] / 1e6,
                 r["floor_b1_tok_s"], r["b1_over_floor"], r.get("b1_over_hf", float("nan")),
                 r.get("b8_over_hf", float("nan"))]  # fmt: skip
        print(f"{name:26s}" + "".join(f"{c:14.2f}" for c in cells))

    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    record = {
        "label": args.label, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "threads": threads, "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "prompt_len": args.prompt_len, "decode_steps": args.decode_steps, "rounds": args.rounds,
        "bandwidth_bytes_s": bandwidth, "rows": rows, "load_average": load,
    }  # fmt: skip
    with open(RESULTS, "w") as f:
        json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
