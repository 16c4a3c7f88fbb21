"""Configuration: one flat, frozen ``EngineArgs`` (what users type) split into per-component configs.

Every field becomes a CLI flag (``--field-name``) and an ``Engine(**kwargs)`` keyword with the same
name. Components never receive ``EngineArgs`` itself: each gets its own small frozen config from the
``*_config()`` methods below, so a component's inputs are visible in its constructor.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin


def _opt(default: Any, help: str, choices: tuple | None = None, *, secret: bool = False) -> Any:
    """A field; a ``secret`` one is left out of ``repr`` and masked by ``public_dict``."""
    return field(
        default=default, repr=not secret, metadata={"help": help, "choices": choices, "secret": secret}
    )


REDACTED = "<redacted>"


@dataclass(frozen=True)
class EngineArgs:
    # --- model and loading
    model_path: str | None = _opt(
        None,
        "GGUF file, Hugging Face directory, a model id in the local Hugging Face cache, or empty for the default model",
    )
    load_format: str = _opt("auto", "how to load weights", ("auto", "gguf", "safetensors", "dummy"))
    dummy_shape: str = _opt("smollm2-135m", "named shape for --load-format dummy")
    tokenizer_path: str | None = _opt(
        None, "tokenizer (GGUF or folder with tokenizer.json) instead of the model's"
    )
    dtype: str = _opt("auto", "compute dtype", ("auto", "float32", "bfloat16", "float16"))
    device: str = _opt("auto", "cpu, cuda or auto", ("auto", "cpu", "cuda"))
    context_length: int | None = _opt(None, "override the model's context length")
    served_model_name: str | None = _opt(None, "model name reported by the API")
    random_seed: int = _opt(0, "seed for weights of dummy models and unseeded sampling")
    attention_backend: str = _opt(
        "auto",
        "attention kernels (auto: triton on CUDA, cpu on the CPU)",
        ("auto", "cpu", "torch_ref", "triton", "flashinfer"),
    )
    gemm_library: str = _opt(
        "auto", "library of the dense matmuls on CUDA (auto: cuBLASLt for hidden sizes >= 4096, "
        "else torch's default, cuBLAS)", ("auto", "cublas", "cublaslt"),
    )  # fmt: skip
    quantization: str = _opt(
        "auto", "quantized linear layers on CPU: gguf computes on a GGUF's own blocks with int8 activations; "
        "int8/int4 are weight-only (float activations); auto: gguf on the CPU for a Q4_1/Q8_0 GGUF, else none",
        ("auto", "none", "gguf", "int8", "int4"),
    )  # fmt: skip
    cpu_threads: int | None = _opt(None, "torch threads of the model on CPU (default: all cores)")
    cuda_graph_max_bs: int = _opt(256, "largest decode batch captured as a CUDA graph")
    disable_cuda_graph: bool = _opt(False, "run decode eagerly on CUDA")
    warmup: str = _opt(
        "auto", "synthetic requests at start-up, so first-use kernel builds and allocations happen "
        "before serving (auto: on CUDA only)", ("auto", "on", "off"),
    )  # fmt: skip
    # --- parallelism (docs/scaling.md)
    tp_size: int = _opt(1, "tensor-parallel ranks: each holds 1/N of every layer (one process per rank)")
    dp_size: int = _opt(1, "data-parallel replicas behind the cache-aware router (each with --tp-size ranks)")
    nnodes: int = _opt(1, "machines the --tp-size ranks span")
    node_rank: int = _opt(0, "this machine's index among --nnodes (0 serves HTTP)")
    dist_init_addr: str | None = _opt(
        None, "HOST:PORT of the torch.distributed rendezvous (required with --nnodes > 1; default: a "
        "free local port)",
    )  # fmt: skip
    base_gpu_id: int = _opt(0, "first GPU this machine's ranks use (rank r on a node takes base + r)")
    # --- memory and cache
    mem_fraction_static: float | None = _opt(None, "fraction of device memory for weights + KV pool")
    max_total_tokens: int | None = _opt(None, "KV pool size in tokens (overrides the memory budget)")
    disable_radix_cache: bool = _opt(False, "do not reuse prefixes across requests")
    kv_cache_dtype: str = _opt("auto", "KV cache dtype", ("auto", "fp8_e4m3"))
    # --- hierarchical cache (device -> host -> storage)
    enable_hierarchical_cache: bool = _opt(False, "keep KV evicted from the device pool in a host pool")
    hicache_ratio: float = _opt(2.0, "host KV pool size as a multiple of the device pool")
    hicache_size: float | None = _opt(None, "host KV pool size in GB (overrides --hicache-ratio)")
    hicache_write_policy: str = _opt(
        "write_through",
        "when device KV is copied to the host: first hit, second hit, or on eviction",
        ("write_through", "write_through_selective", "write_back"),
    )
    hicache_storage_backend: str | None = _opt(None, "storage tier below the host pool", (None, "file"))
    hicache_storage_dir: str | None = _opt(None, "directory of the file storage tier")
    hicache_storage_prefetch_policy: str = _opt(
        "timeout",
        "how long a request waits for its prefix from storage",
        ("best_effort", "wait_complete", "timeout"),
    )
    # --- scheduling
    max_running_requests: int | None = _opt(None, "cap on requests decoding at once")
    chunked_prefill_size: int | None = _opt(
        None,
        "max new tokens of one request per prefill pass (default: 512 on the CPU; on CUDA 16384 "
        "for models under 4 GB of weights, else 8192)",
    )
    max_prefill_tokens: int = _opt(16384, "token budget of one prefill batch")
    schedule_policy: str = _opt("fcfs", "waiting-queue order", ("fcfs", "lpm"))
    schedule_conservativeness: float = _opt(1.0, "scales the initial new-token ratio")
    enable_mixed_chunk: bool = _opt(False, "run decode rows in the same pass as a prefill chunk")
    enable_priority_scheduling: bool = _opt(False, "order by request priority and preempt lower ones")
    priority_preemption_threshold: int = _opt(10, "min priority gap for a waiting request to preempt")
    disable_overlap_schedule: bool = _opt(False, "process step N's results before launching step N+1")
    enable_cpu_overlap_schedule: bool = _opt(
        False, "the overlap loop on the CPU too (off by default: it shares the cores)"
    )
    enable_deterministic_inference: bool = _opt(False, "batch-invariant kernels: same text in any batch")
    num_continuous_decode_steps: int = _opt(
        0, "decode steps (greedy EAGLE chain steps with speculation) run back to back, without the "
        "scheduler between them (1 = off; 0 = auto: up to 8 on CUDA within --continuous-decode-budget-ms, "
        "1 elsewhere and with speculation)",
    )  # fmt: skip
    continuous_decode_budget_ms: float | None = _opt(
        None, "device time one launch of several plain decode steps may take, at the measured device time "
        "per step "
        "(default: 8 on CUDA when the step count is auto; none when a count is given)",
    )  # fmt: skip
    stream_interval: int = _opt(1, "send streaming output every N tokens")
    log_interval: int = _opt(40, "decode steps between two log lines")
    # --- grammars
    grammar_backend: str = _opt(
        "xgrammar", "constrained decoding backend", ("xgrammar", "llguidance", "outlines", "none")
    )
    grammar_on_device: str = _opt(
        "auto",
        "regex and regular JSON schema grammars as token automata on the device (masked inside "
        "continuous decode); auto: on CUDA without speculative decoding",
        ("auto", "on", "off"),
    )
    grammar_compile_timeout: float = _opt(30.0, "seconds before a grammar compile fails its request")
    enable_jump_forward: bool = _opt(False, "append grammar-forced text without a forward per token")
    # --- speculative decoding
    speculative_algorithm: str | None = _opt(None, "speculative decoding", (None, "EAGLE", "NGRAM"))
    speculative_draft_model_path: str | None = _opt(None, "EAGLE head (default: the shipped head)")
    speculative_num_steps: int | None = _opt(
        None, "draft depth (default: 3 on CUDA; 1 on the CPU, where each verified row past the "
        "second costs about a quarter of a decode step)",
    )  # fmt: skip
    speculative_eagle_topk: int = _opt(1, "candidates per draft level")
    speculative_num_draft_tokens: int | None = _opt(
        None, "tree nodes verified per step (default: 4 on CUDA; on the CPU 2 with EAGLE, 3 with NGRAM)"
    )
    # --- server
    host: str = _opt("127.0.0.1", "address to bind")
    port: int = _opt(30000, "port to bind")
    api_key: str | None = _opt(
        None, "bearer token required on all routes but /health and /metrics", secret=True
    )
    max_request_body_bytes: int = _opt(16 * 1024 * 1024, "largest request body accepted")
    strict_api: bool = _opt(
        False, "refuse unknown fields on the OpenAI routes with a 400 naming them, as the OpenAI API "
        "does (default: ignore them; the native routes always refuse them)",
    )  # fmt: skip
    log_level: str = _opt("info", "log level", ("debug", "info", "warning", "error"))
    log_requests: bool = _opt(False, "log every request")
    watchdog_timeout: float = _opt(
        300.0, "seconds one scheduler step may run (or the scheduler stay silent) before the engine "
        "counts as hung: the scheduler, or else the server, logs why and exits non-zero",
    )  # fmt: skip
    metrics_prefix: str = _opt(
        "phloem",
        "prefix of the /metrics names (sglang: the names dashboards built for SGLang read)",
        ("phloem", "sglang"),
    )

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def public_dict(self) -> dict[str, Any]:
        """``to_dict`` with every secret that is set replaced by ``REDACTED``: what a route or a
        log line may show."""
        out = self.to_dict()
        for f in dataclasses.fields(self):
            if f.metadata.get("secret") and out[f.name] is not None:
                out[f.name] = REDACTED
        return out

    # ---- CLI -----------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_ = f.metadata.get("help", "")
            choices = f.metadata.get("choices")
            tp = _base_type(f.type)
            if tp is bool:
                parser.add_argument(flag, action="store_true", default=f.default, help=help_)
                continue
            kwargs: dict[str, Any] = {"default": f.default, "help": help_, "type": tp}
            if choices is not None:
                kwargs["choices"] = [c for c in choices if c is not None]
            parser.add_argument(flag, dest=f.name, **kwargs)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})

    @classmethod
    def from_kwargs(cls, model_path: str | None = None, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(model_path=model_path, **kwargs)


def config_markdown() -> str:
    """``docs/config.md``: every option with its flag, default and help (kept in sync by a test)."""
    lines = [
        "# Configuration",
        "",
        "Every option is a `phloem serve` / `phloem generate` flag and an `Engine(**kwargs)` keyword",
        "of the same name. Generated from `runtime/config.py` (`python -m phloem.runtime.config`).",
        "",
        "| flag | default | choices | meaning |",
        "|---|---|---|---|",
    ]
    for f in dataclasses.fields(EngineArgs):
        choices = f.metadata.get("choices")
        shown = ", ".join(str(c) for c in choices if c is not None) if choices else ""
        flag = "--" + f.name.replace("_", "-")
        lines.append(f"| `{flag}` | `{f.default}` | {shown} | {f.metadata.get('help', '')} |")
    return "\n".join(lines + _switches_markdown()) + "\n"


def _switches_markdown() -> list[str]:
    """The environment switches (``runtime/switches.py``): process-wide kernel and diagnosis
    choices that are not engine options."""
    from phloem.runtime.switches import SWITCHES

    lines = [
        "",
        "## Environment switches",
        "",
        "Read from the environment when the object that uses them is built or on first use, never",
        "at import; declared in `runtime/switches.py`, the only module that reads them.",
        "",
        "| variable | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for sw in SWITCHES:
        default = f"`{sw.default}`" if sw.default != "" else "(empty)"
        lines.append(f"| `{sw.name}` | {sw.kind.__name__} | {default} | {sw.meaning} |")
    return lines


def _base_type(annotation: Any) -> type:
    """'int | None' -> int; annotations are strings under ``from __future__ import annotations``."""
    if isinstance(annotation, str):
        head = annotation.split("|")[0].strip()
        return {"int": int, "float": float, "bool": bool, "str": str}.get(head, str)
    if get_origin(annotation) is Literal:
        return type(get_args(annotation)[0])
    return annotation if isinstance(annotation, type) else str


if __name__ == "__main__":
    print(config_markdown(), end="")
