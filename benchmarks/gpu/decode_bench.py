"""Decode throughput on a CUDA device against the memory floor (DESIGN.md §11).

For each dummy model shape, attention backend and batch size, every request holds ``--context``
tokens of KV and the batch decodes one token per request per step through ``ModelRunner.forward``
(greedy sampling, host copy of the sampled ids, waiting for it as the scheduler does). With
``cuda_graph`` the decode forward replays a captured graph (``runtime/executor/cuda_graph.py``).

    floor bytes / step = weights read (embedding table left out unless tied) + B * context * KV bytes
    floor time = bytes / copy bandwidth (a large device-to-device copy, bytes read + written)
    ratio = measured step time / floor time   (1.0 is the memory-bound ideal)

``--fused on off`` runs every point with the fused CUDA layer kernels (``runtime/layers/fused_triton.py``)
and with their torch references, recapturing the graphs for each.

Usage (in the repository root, on the GPU machine)::

    python3 -m benchmarks.gpu.decode_bench --out $OUT/decode_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

MODELS = ["smollm2-135m", "llama3-8b"]
BACKENDS = ["torch_ref", "triton"]
BATCHES = [1, 64, 256]


def copy_bandwidth(nbytes: int = 4 << 30, reps: int = 20) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus written (median of ``reps``)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return nbytes / sorted(times)[len(times) // 2]


def _fast_dummy_weights() -> None:
    """Dummy weights drawn on the device: values do not matter for speed, and the CPU draw of 8B
    normals would take minutes."""
    import phloem.runtime.executor.dummy as dummy

    def init(model, *, seed: int = 0, std: float = 0.02) -> None:
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std)

    dummy.init_dummy_weights = init


def make_runner(shape: str, max_bs: int, context: int):
    from phloem.runtime.executor.model_runner import ModelRunner
    from phloem.runtime.model_files import resolve_model

    return ModelRunner(
        resolve_model(shape, "dummy"),
        dtype="bfloat16",
        device="cuda",
        attention_backend="triton",
        max_total_tokens=max_bs * context + 16,
        max_running_requests=max_bs,
        context_len=context + 16,
        cuda_graph_max_bs=0,  # the benchmark captures its own graphs (per backend and fused mode)
    )


def decode_input(runner, bs: int, context: int, gen: torch.Generator):
    """A decode batch of ``bs`` requests at position ``context - 1``, slots scattered over the pool."""
    from phloem.runtime.executor.forward_io import ForwardInput, ForwardMode
    from phloem.runtime.executor.model_runner import greedy_sampling_info

    table = runner.req_to_token_pool.req_to_token
    slots = torch.randperm(bs * context, generator=gen) + 1
    table[:bs, :context] = slots.view(bs, context).to(table.device)

    def pinned(x: torch.Tensor) -> torch.Tensor:
        return x.pin_memory()

    return ForwardInput(
        mode=ForwardMode.DECODE,
        input_ids=pinned(torch.randint(0, runner.vocab_size, (bs,), generator=gen)),
        positions=pinned(torch.full((bs,), context - 1, dtype=torch.int64)),
        out_slots=pinned(slots.view(bs, context)[:, -1].clone()),
        req_pool_indices=pinned(torch.arange(bs)),
        seq_lens=pinned(torch.full((bs,), context, dtype=torch.int64)),
        prefix_lens=pinned(torch.full((bs,), context - 1, dtype=torch.int64)),
        extend_lens=pinned(torch.ones(bs, dtype=torch.int64)),
        sampling=greedy_sampling_info(bs),
    )


def time_steps(runner, fi, *, min_steps: int = 10, min_seconds: float = 1.0) -> float:
    """Median seconds per decode step (each step waits for its sampled ids, as the scheduler does)."""
    for _ in range(3):
        runner.forward(fi).synchronize()
    times: list[float] = []
    begin = time.perf_counter()
    while len(times) < min_steps or time.perf_counter() - begin < min_seconds:
        t0 = time.perf_counter()
        runner.forward(fi).synchronize()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return sorted(times)[len(times) // 2]


def use_graphs(runner, graphs) -> None:
    """Route decode through ``graphs`` (or force eager with ``None``), whatever the runner captured."""
    runner.cuda_graphs = graphs


def graph_gpu_ms(graphs, fi) -> float:
    """Device time of one graph replay alone (inputs already on the device), median of 20."""
    dev = fi.to("cuda")
    times = []
    for i in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.replay(dev)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return round(sorted(times)[len(times) // 2], 4)


def weights_read(runner) -> int:
    cfg = runner.model_config
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * runner.dtype.itemsize
    return runner.weight_bytes - embed


def _check_input(runner, context: int):
    return decode_input(runner, 3, context, torch.Generator().manual_seed(5)).to("cuda")


def eager_logits(runner, fi) -> torch.Tensor:
    """Logits of decode batch ``fi`` without graphs (``runner.cuda_graphs`` must be ``None``)."""
    with torch.inference_mode():
        return type(runner)._logits(runner, fi, runner._logit_rows(fi))[0].clone()


def check_graph_matches_eager(runner, graphs, context: int) -> float:
    """Max |graph - eager| / max |eager| over the logits of a 3-row batch (replayed padded to 4)."""
    fi = _check_input(runner, context)
    eager = eager_logits(runner, fi)
    with torch.inference_mode():
        graph = graphs.replay(fi).clone()
    return float((eager - graph).abs().max() / eager.abs().max())


def check_fused_matches_unfused(runner, context: int) -> float:
    """Max |fused - unfused| / max |unfused| over the eager logits of a 3-row batch, run back to
    back so both read the same KV pool."""
    from phloem.runtime.layers.fusion import fused_kernels_enabled

    before = "on" if fused_kernels_enabled() else "off"
    fi = _check_input(runner, context)
    set_fused("off")
    unfused = eager_logits(runner, fi)
    set_fused("on")
    fused = eager_logits(runner, fi)
    set_fused(before)
    return float((fused - unfused).abs().max() / unfused.abs().max())


def set_fused(mode: str) -> None:
    """``on``/``off``: the fused CUDA layer kernels (``runtime/layers/fused_triton.py``); graphs
    captured afterwards keep the path in force."""
    from phloem.runtime.layers.fusion import set_fused_kernels

    set_fused_kernels(mode == "on")


def bench_model(
    shape: str,
    *,
    backends: list[str],
    batches: list[int],
    context: int,
    cuda_graph_max_bs: int,
    fused_modes: list[str],
    bandwidth: float,
) -> tuple[list[dict], dict]:
    """Rows for one dummy model shape (every backend x fused mode x graph on/off x batch) and the
    capture records, keyed ``model/backend/fused-MODE`` (with both modes, ``model/backend`` holds
    the fused vs unfused logits difference)."""
    from phloem.runtime.attention.registry import get_attention_backend_class
    from phloem.runtime.executor.cuda_graph import CudaGraphRunner
    from phloem.runtime.layers.fusion import fused_kernels_enabled, set_fused_kernels

    fused_before = fused_kernels_enabled()
    results, captures = [], {}
    runner = make_runner(shape, max(batches), context)
    kv_per_token = runner.kv_pool.bytes_per_token
    w_bytes = weights_read(runner)
    for backend in backends:
        cls = get_attention_backend_class(backend)
        runner.attn_backend = cls(
            runner.kv_pool, runner.req_to_token_pool, num_heads=runner.model_config.num_heads
        )
        if {"on", "off"} <= set(fused_modes):
            rel = check_fused_matches_unfused(runner, context)
            captures[f"{shape}/{backend}"] = {"fused_vs_unfused_logits_rel_max_diff": rel}
            print(f"{shape}/{backend}: fused vs unfused eager logits rel diff {rel:.2e}", flush=True)
        for fused in fused_modes:
            set_fused(fused)
            graphs = None
            if getattr(runner.attn_backend, "supports_cuda_graph", False):
                graphs = CudaGraphRunner(runner.model, runner.attn_backend, max_bs=cuda_graph_max_bs)
                graphs.capture()
                rel = check_graph_matches_eager(runner, graphs, context)
                captures[f"{shape}/{backend}/fused-{fused}"] = {
                    "batch_sizes": graphs.batch_sizes,
                    "seconds": round(graphs.capture_seconds, 3),
                    "mib": round(graphs.capture_bytes / 2**20, 1),
                    "graph_vs_eager_rel_max_diff": rel,
                }
                print(f"{shape}/{backend}/fused-{fused}: captured {len(graphs.batch_sizes)} graphs in "
                      f"{graphs.capture_seconds:.2f} s, {graphs.capture_bytes / 2**20:.0f} MiB; "
                      f"graph vs eager rel diff {rel:.2e}", flush=True)  # fmt: skip
            for cuda_graph in (False, True) if graphs is not None else (False,):
                use_graphs(runner, graphs if cuda_graph else None)
                for bs in batches:
                    fi = decode_input(runner, bs, context, torch.Generator().manual_seed(bs))
                    step = time_steps(runner, fi)
                    gpu_ms = graph_gpu_ms(graphs, fi) if cuda_graph else None
                    nbytes = w_bytes + bs * context * kv_per_token
                    floor = nbytes / bandwidth
                    row = {
                        "model": shape, "backend": backend, "fused": fused == "on",
                        "cuda_graph": cuda_graph, "batch": bs,
                        "context": context, "step_ms": round(step * 1e3, 4),
                        "tok_s": round(bs / step, 1), "bytes_per_step": nbytes,
                        "floor_ms": round(floor * 1e3, 4), "floor_tok_s": round(bs / floor, 1),
                        "ratio": round(step / floor, 2),
                        "graph_replay_gpu_ms": gpu_ms,
                    }  # fmt: skip
                    results.append(row)
                    print(json.dumps(row), flush=True)
            del graphs
            use_graphs(runner, None)
            torch.cuda.empty_cache()
    set_fused_kernels(fused_before)
    del runner
    torch.cuda.empty_cache()
    return results, captures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--backends", nargs="+", default=BACKENDS)
    ap.add_argument("--batches", nargs="+", type=int, default=BATCHES)
    ap.add_argument("--context", type=int, default=1024, help="KV tokens per request")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=256)
    ap.add_argument(
        "--fused", nargs="+", choices=["on", "off"], default=["on"],
        help="fused CUDA layer kernels; 'on off' measures both",
    )  # fmt: skip
    args = ap.parse_args()

    _fast_dummy_weights()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    results, captures = [], {}
    for shape in args.models:
        rows, caps = bench_model(
            shape, backends=args.backends, batches=args.batches, context=args.context,
            cuda_graph_max_bs=args.cuda_graph_max_bs, fused_modes=args.fused, bandwidth=bandwidth,
        )  # fmt: skip
        results += rows
        captures.update(caps)

    report = {
        "benchmark": "decode_bench",
        "command": " ".join(
            [os.path.basename(sys.executable), "-m", "benchmarks.gpu.decode_bench", *sys.argv[1:]]
        ),
        "git_commit": os.environ.get("GIT_COMMIT") or _git_commit(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "copy_bandwidth_bytes_s": bandwidth,
        "floor": "(weights read + batch * context * KV bytes per token) / copy bandwidth",
        "captures": captures,
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_table(results)
    return 0


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def run_record(benchmark: str, dtype: torch.dtype, bandwidth: float) -> dict:
    """The fields every GPU benchmark's JSON starts with: what ran, on which code and machine."""
    return {
        "benchmark": benchmark,
        "command": " ".join(
            [os.path.basename(sys.executable), "-m", f"benchmarks.gpu.{benchmark}", *sys.argv[1:]]
        ),
        "git_commit": os.environ.get("GIT_COMMIT") or _git_commit(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "dtype": str(dtype),
        "copy_bandwidth_bytes_s": bandwidth,
    }


def print_table(results: list[dict]) -> None:
    print(
        f"{'model':14} {'backend':9} {'fused':5} {'graph':5} {'batch':>5} {'step ms':>9} {'tok/s':>10} {'floor ms':>9} {'ratio':>6} {'replay ms':>9}"
    )
    for r in results:
        print(f"{r['model']:14} {r['backend']:9} {r.get('fused', True)!s:5} {r['cuda_graph']!s:5} {r['batch']:>5} {r['step_ms']:>9.3f} "
              f"{r['tok_s']:>10.1f} {r['floor_ms']:>9.3f} {r['ratio']:>6.2f} {r['graph_replay_gpu_ms'] or '-':>9}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
