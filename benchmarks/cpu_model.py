"""One-batch CPU model benchmark: phloem's ModelRunner vs transformers on the same model.

Prints one table: prefill tok/s for a 512-token prompt, decode tok/s at batch 1 and 8, for
phloem (float32 and bfloat16) and transformers ``generate`` (float32), next to the floor (weight
bytes read per decode step / memory bandwidth, measured here with a large tensor copy).
Writes ``benchmarks/results/cpu_model.json``.

    python benchmarks/cpu_model.py [--threads 1] [--decode-steps 32] [--skip-hf]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable

import torch
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.model_files import resolve_model

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu_model.json")


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


def bench_phloem(dtype: str, prompt_len: int, steps: int, repeat: int) -> dict[str, float]:
    runner = ModelRunner(resolve_model(None), dtype=dtype, device="cpu", max_total_tokens=16384,
                         max_running_requests=16, sampler=argmax_sampler)  # fmt: skip
    b = DirectBatcher(runner)
    prompt = [(i * 7919) % 40000 + 100 for i in range(prompt_len)]

    def prefill() -> None:
        seq = b.new_sequence()
        b.step({seq: prompt})
        b.release(seq)

    prefill()  # warm-up
    out = {"prefill_tok_s": prompt_len / best_of(prefill, repeat)}
    for batch in (1, 8):
        b._next_slot = 1  # reuse the pool between measurements
        seqs = [b.new_sequence() for _ in range(batch)]
        b.step({s: prompt[:64] for s in seqs})

        def decode(seqs: list[int] = seqs) -> None:
            for _ in range(steps):
                b.step({s: [42] for s in seqs}, decode=True)

        out[f"decode_b{batch}_tok_s"] = batch * steps / best_of(decode, 1)
        for s in seqs:
            b.release(s)
    out["weight_bytes"] = runner.weight_bytes
    return out


def bench_hf(prompt_len: int, steps: int, repeat: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    path = resolve_model(None).path
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    prompt = torch.tensor([[(i * 7919) % 40000 + 100 for i in range(prompt_len)]])
    out = {}
    with torch.inference_mode():
        model(prompt[:, :32])
        out["prefill_tok_s"] = prompt_len / best_of(lambda: model(prompt), repeat)
        for batch in (1, 8):
            ids = prompt[:, :64].repeat(batch, 1)

            def gen(n: int, ids: torch.Tensor = ids) -> None:
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)

            full, first = best_of(lambda: gen(steps + 1), 1), best_of(lambda: gen(1), 1)
            out[f"decode_b{batch}_tok_s"] = batch * steps / max(full - first, 1e-9)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-bf16", action="store_true")
    parser.add_argument("--label", default="", help="free text stored with the results")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    bandwidth = memory_bandwidth()
    rows = {"phloem fp32": bench_phloem("float32", args.prompt_len, args.decode_steps, args.repeat)}
    if not args.skip_bf16:
        rows["phloem bf16"] = bench_phloem("bfloat16", args.prompt_len, args.decode_steps, args.repeat)
    if not args.skip_hf:
        rows["transformers fp32"] = bench_hf(args.prompt_len, args.decode_steps, args.repeat)
    weight_bytes = rows["phloem fp32"]["weight_bytes"]
    floor_step = weight_bytes / bandwidth  # seconds per decode step if only weight reads counted
    rows["floor fp32"] = {"decode_b1_tok_s": 1 / floor_step, "decode_b8_tok_s": 8 / floor_step}

    print(f"threads={torch.get_num_threads()} bandwidth={bandwidth / 1e9:.1f} GB/s "
          f"weights={weight_bytes / 1e6:.0f} MB fp32 floor={floor_step * 1e3:.1f} ms/step")  # fmt: skip
    print(
        f"{'':20s} {'prefill tok/s':>14s} {'decode b1 tok/s':>16s} {'decode b8 tok/s':>16s} {'b1/floor':>9s}"
    )
    for name, r in rows.items():
        pre = f"{r['prefill_tok_s']:14.1f}" if "prefill_tok_s" in r else f"{'-':>14s}"
        ratio = r["decode_b1_tok_s"] * floor_step
        print(f"{name:20s} {pre} {r['decode_b1_tok_s']:16.1f} {r['decode_b8_tok_s']:16.1f} {ratio:9.2f}")

    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    record = {
        "label": args.label, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "prompt_len": args.prompt_len, "decode_steps": args.decode_steps,
        "bandwidth_bytes_s": bandwidth, "floor_s_per_step": floor_step, "rows": rows,
        "load_average": os.getloadavg(),
    }  # fmt: skip
    with open(RESULTS, "w") as f:
        json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
