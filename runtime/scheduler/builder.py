"""Assembles a ``Scheduler`` and its collaborators from ``EngineArgs`` (scheduler process only).

Each collaborator receives only what it needs; ``EngineArgs`` stops here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phloem.runtime import switches
from phloem.runtime.config import EngineArgs
from phloem.runtime.scheduler.output import OutputCollector
from phloem.runtime.scheduler.policy import continuous_decode_plan
from phloem.runtime.scheduler.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger("phloem.scheduler")
SPEC_MAX_RUNNING = 32  # default cap on running requests with speculative decoding
# New tokens per request of a short extend graph under jump-forward: a forced run (a JSON key
# with its punctuation) plus the retokenized tail and the token before it.
JUMP_GRAPH_TOKENS = 16


@dataclass
class SchedulerRuntime:
    """What the process loop needs besides the Scheduler itself."""

    runner: Any
    tokenizer: Any
    cache: Any
    eos_token_ids: set[int]
    info: dict[str, Any]
    send_detokenizer: Callable[[Any], None] = lambda m: None
    tp_steps: Any = None  # tp_step.StepBroadcaster on rank 0 of a --tp-size > 1 engine


SMALL_MODEL_BYTES = 4 << 30  # decode weight bytes below which a CUDA prefill pass takes 16,384 tokens


def default_chunked_prefill_size(device_type: str, weight_bytes: int = 0) -> int:
    """Tokens of one prefill pass when ``--chunked-prefill-size`` is not given.

    CPU: 512. Passes are slow there, and small chunks bound the decode latency of running requests.

    CUDA, models under 4 GB of weights: 16,384. An 8,192-token pass of such a model does less GPU
    work than the host needs to launch it (hundreds of kernel launches under the GIL), so the
    pass is host-bound and a longer one raises throughput.

    CUDA, larger models: 8,192. Such passes are GPU-bound already; a longer one buys nothing.
    """
    if device_type == "cpu":
        return 512
    return 16384 if 0 < weight_bytes < SMALL_MODEL_BYTES else 8192


def use_overlap(args: EngineArgs, device_type: str) -> bool:
    """Whether the scheduler runs the overlap loop.

    On CUDA it does unless ``--disable-overlap-schedule``. On the CPU only with
    ``--enable-cpu-overlap-schedule``: there the forward pass runs on the same cores as the
    scheduler, so the worker thread buys no parallel device, and the scheduler's bookkeeping takes
    cycles (and the GIL) from the model's threads, so decoding is faster with it off. Speculative
    decoding always runs the non-overlap loop (the draft of step N+1 needs step N's tokens).
    """
    if args.disable_overlap_schedule or args.speculative_algorithm is not None:
        return False
    return device_type != "cpu" or args.enable_cpu_overlap_schedule


def build_scheduler(args: EngineArgs, *, send: Callable[[Any], None]) -> tuple[Scheduler, SchedulerRuntime]:
    import torch
    from phloem.runtime.cache.allocator import TokenSlotAllocator
    from phloem.runtime.cache.cache_manager import CacheManager
    from phloem.runtime.cache.radix_tree import RadixTree
    from phloem.runtime.executor.worker import FutureMap, InlineWorker, OverlapWorker
    from phloem.runtime.model_files import resolve_model
    from phloem.runtime.sampling.batch import SamplingBatchBuilder
    from phloem.runtime.tokenizer.tokenizer import load_tokenizer

    torch.manual_seed(args.random_seed)
    source = resolve_model(args.model_path, args.load_format, dummy_shape=args.dummy_shape)
    tokenizer = load_tokenizer(source, args.tokenizer_path)
    args, tp = _join_tp_group(args)
    runner = model_runner(args, source)
    pool_rows = runner.req_to_token_pool
    allocator = TokenSlotAllocator(runner.kv_pool.num_slots)
    tree = None if args.disable_radix_cache else RadixTree()
    hicache = _hierarchical_cache(args, runner, tree, source)
    cache = CacheManager(allocator=allocator, req_to_token=pool_rows.req_to_token, tree=tree, hicache=hicache)
    cfg = _scheduler_config(args, runner)
    spec = _speculative_step(args, runner, cfg)
    future_map = FutureMap(4 * cfg.max_running_requests + 8, device=runner.device)
    worker = OverlapWorker(runner, future_map) if cfg.overlap else InlineWorker(runner, future_map)
    eos = set(tokenizer.eos_token_ids)
    sampling = SamplingBatchBuilder(
        runner.vocab_size, eos_token_ids=eos, pin_memory=runner.device.type == "cuda", device=runner.device
    )
    grammar = _grammar_queue(args, tokenizer, runner, eos)
    scheduler = Scheduler(
        cfg,
        cache=cache,
        req_pool=pool_rows,
        worker=worker,
        sampling=sampling,
        outputs=OutputCollector(send, stream_interval=args.stream_interval),
        grammar=grammar,
        spec=spec,
    )
    info = _server_info(args, runner, cfg, hicache)
    runtime = SchedulerRuntime(runner=runner, tokenizer=tokenizer, cache=cache, eos_token_ids=eos, info=info)
    if tp.size > 1:
        from phloem.runtime.executor.tp_step import StepBroadcaster

        runtime.tp_steps = StepBroadcaster(tp, pool_rows.req_to_token)
        runtime.tp_steps.hello(future_map.size)
        worker.before_step = runtime.tp_steps
    return scheduler, runtime


def _join_tp_group(args: EngineArgs) -> tuple[EngineArgs, Any]:
    """Rank 0's device (``--base-gpu-id`` on CUDA) and, with ``--tp-size`` above 1, its place in
    the tensor-parallel group (the followers join from their own processes)."""
    import torch
    from phloem.runtime.distributed.ranks import init_method, rank_device
    from phloem.runtime.distributed.state import get_tp, init_tp

    device = rank_device(args.device, args.base_gpu_id)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        args = args.replace(device=device)
    if args.tp_size == 1:
        return args, get_tp()
    assert args.dist_init_addr is not None, "the launcher sets the rendezvous address"
    tp = init_tp(
        rank=0, size=args.tp_size, init_method=init_method(args.dist_init_addr), device=torch.device(device)
    )
    return args, tp


def cpu_threads_per_rank(args: EngineArgs) -> int | None:
    """``--cpu-threads``, or with CPU tensor parallelism an equal share of this node's cores per rank:
    ranks that oversubscribe the cores wait in every all-reduce for a descheduled partner."""
    if args.cpu_threads is not None or args.tp_size == 1:
        return args.cpu_threads
    import os

    return max(1, (os.cpu_count() or 1) // (args.tp_size // args.nnodes))


def model_runner(args: EngineArgs, source: Any) -> Any:
    """The model runner ``args`` describe (every tensor-parallel rank builds its own)."""
    from phloem.runtime.executor.model_runner import ModelRunner

    return ModelRunner(
        source,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        max_running_requests=args.max_running_requests,
        context_len=args.context_length,
        seed=args.random_seed,
        deterministic=args.enable_deterministic_inference,
        quantization=None if args.quantization == "none" else args.quantization,
        cpu_threads=cpu_threads_per_rank(args),
        cuda_graph_max_bs=0 if args.disable_cuda_graph else args.cuda_graph_max_bs,
        kv_cache_dtype=args.kv_cache_dtype,
        gemm_library=args.gemm_library,
        # jump-forward extends each forced run (a JSON key) in one short pass: from a graph
        extend_graph_tokens=JUMP_GRAPH_TOKENS if jump_forward_on(args) else 0,
        chain_width=chain_width(args),
    )


def chain_width(args: EngineArgs) -> int:
    """Nodes a row of chain decode launches (``PHLOEM_JUMP_CHAIN``; -1: the runner's default for
    its device) with jump-forward, grammars that may run on the device and one rank; else 0."""
    width = switches.JUMP_CHAIN.number()
    if width < -1 or width == 1:
        name = switches.JUMP_CHAIN.name
        raise ValueError(f"{name} must be -1 (the device's default), 0 (off) or 2 or more, got {width}")
    if width == 0 or not jump_forward_on(args) or args.grammar_on_device == "off" or args.tp_size > 1:
        return 0
    return width


def jump_forward_on(args: EngineArgs) -> bool:
    """Jump-forward is asked for and allowed (speculative decoding turns it off)."""
    return args.enable_jump_forward and args.speculative_algorithm is None


def _max_running(args: EngineArgs, runner: Any, speculative: bool) -> int:
    max_running = min(args.max_running_requests or runner.max_running_requests, runner.req_to_token_pool.size)
    if speculative and args.max_running_requests is None and max_running > SPEC_MAX_RUNNING:
        # each running request reserves a whole draft tree per step, and drafting pays only while
        # the verify pass is memory-bound: beyond a few dozen rows plain decoding wins
        max_running = SPEC_MAX_RUNNING
        logger.info("speculative decoding: max_running_requests=%d (set --max-running-requests to change)",
                    max_running)  # fmt: skip
    return max_running


def _scheduler_config(args: EngineArgs, runner: Any) -> SchedulerConfig:
    chunk = args.chunked_prefill_size or default_chunked_prefill_size(runner.device.type, runner.decode_weight_bytes)
    speculative = args.speculative_algorithm is not None
    jump_forward = jump_forward_on(args)
    if args.enable_jump_forward and speculative:
        logger.warning("jump-forward is off with speculative decoding")
    decode_steps, decode_budget_s = continuous_decode_plan(
        args.num_continuous_decode_steps,
        args.continuous_decode_budget_ms,
        device_type=runner.device.type,
        speculative=speculative,
    )
    return SchedulerConfig(
        max_running_requests=_max_running(args, runner, speculative),
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=chunk if chunk > 0 else None,
        schedule_policy=args.schedule_policy,
        schedule_conservativeness=args.schedule_conservativeness,
        enable_mixed_chunk=args.enable_mixed_chunk,
        enable_priority_scheduling=args.enable_priority_scheduling,
        priority_preemption_threshold=args.priority_preemption_threshold,
        overlap=use_overlap(args, runner.device.type),
        stream_interval=args.stream_interval,
        log_interval=args.log_interval,
        enable_jump_forward=jump_forward,
        jump_overlap=switches.JUMP_FORWARD_OVERLAP.flag(),
        jump_extend_overlap=switches.JUMP_EXTEND_OVERLAP.flag(),
        **_jump_lead_shape(runner, jump_forward and not speculative),
        **_chain_shape(runner),
        decode_steps=decode_steps,
        decode_budget_s=decode_budget_s,
        decode_early_exit=getattr(getattr(runner, "cuda_graphs", None), "exit", None) is not None,
    )


def _jump_lead_shape(runner: Any, jump_forward: bool) -> dict[str, int]:
    """``jump_lead_rows`` and ``jump_lead_tokens`` under ``PHLOEM_JUMP_LEAD``: the short extend
    graphs' shape on CUDA (none captured: no lead passes, an eager one costs more than it saves),
    the same shape run eagerly on the CPU."""
    if not jump_forward or not switches.JUMP_LEAD.flag():
        return {}
    graphs = getattr(runner, "extend_graphs", None)
    if graphs is not None:
        return {"jump_lead_rows": graphs.limit, "jump_lead_tokens": graphs.width}
    if runner.device.type == "cpu":
        from phloem.runtime.executor.model_runner import EXTEND_GRAPH_MAX_BS

        return {"jump_lead_rows": EXTEND_GRAPH_MAX_BS, "jump_lead_tokens": JUMP_GRAPH_TOKENS}
    return {}


def _chain_shape(runner: Any) -> dict[str, int]:
    """``jump_chain_width`` and ``jump_chain_rows``: the chain decoder's width and its largest
    graph on CUDA (larger batches decode without chains: an eager chain pass costs more than it
    saves), any batch on the CPU; nothing without a chain decoder."""
    chains = getattr(runner, "chain_decoder", None)
    if chains is None:
        return {}
    if runner.device.type == "cpu":
        return {"jump_chain_width": chains.width, "jump_chain_rows": runner.max_running_requests}
    if not chains.batch_sizes:
        return {}
    return {"jump_chain_width": chains.width, "jump_chain_rows": chains.batch_sizes[-1]}


def speculative_shape(args: EngineArgs, device_type: str) -> tuple[int, int]:
    """``(num_steps, num_draft_tokens)``: the given values, else the device's defaults.

    On a GPU a verify pass of a few rows costs about one decode step, so drafting deep pays: a
    chain of 3 (4 nodes). On the CPU each verified row beyond the second adds about a quarter of a
    decode step of integer-dot compute (``layers/qdot_kernels.h``), so short drafts win: EAGLE a
    chain of 1, n-gram 2 drafts (measured in docs/benchmarks.md: 1.08x and 1.14x of plain decoding
    at batch 1, where the GPU defaults give 0.77x and 1.01x).
    """
    cpu = device_type == "cpu"
    steps = args.speculative_num_steps
    if steps is None:
        steps = 1 if cpu else 3
    tokens = args.speculative_num_draft_tokens
    if tokens is None:
        tokens = (3 if args.speculative_algorithm == "NGRAM" else steps + 1) if cpu else 4
    return steps, tokens


def _speculative_step(args: EngineArgs, runner: Any, cfg: SchedulerConfig) -> Any:
    if args.speculative_algorithm is None:
        return None
    from phloem.runtime.speculative.step import build_speculative_step

    num_steps, num_draft_tokens = speculative_shape(args, runner.device.type)
    return build_speculative_step(
        runner,
        args.speculative_algorithm,
        draft_model_path=args.speculative_draft_model_path,
        num_steps=num_steps,
        topk=args.speculative_eagle_topk,
        num_draft_tokens=num_draft_tokens,
        seed=args.random_seed,
        max_batch=min(cfg.max_running_requests, args.cuda_graph_max_bs),
        window_steps=cfg.decode_steps,
    )


def _server_info(args: EngineArgs, runner: Any, cfg: SchedulerConfig, hicache: Any) -> dict[str, Any]:
    """What ``get_server_info`` reports of the scheduler's setup; logged once at start-up."""
    info = {
        "max_total_num_tokens": runner.max_total_num_tokens,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "max_running_requests": cfg.max_running_requests,
        "max_prefill_tokens": args.max_prefill_tokens,
        "context_length": runner.context_len,
        "vocab_size": runner.vocab_size,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "device": str(runner.device),
        "attention_backend": runner.attention_backend_name,
        "gemm_library": runner.gemm_library,
        "quantization": runner.quantization or "none",
        "quant_kernel": runner.quant_kernel,
        "available_mem_gb": round(getattr(runner, "available_mem_bytes", 0) / 2**30, 2),
        "hicache_host_tokens": hicache.host_pool.size if hicache is not None else 0,
        "overlap_schedule": cfg.overlap,
        "tp_size": args.tp_size,
    }
    kv_bytes = runner.kv_pool.bytes_per_token * runner.kv_pool.num_slots
    # the memory probe is a CUDA figure; on the CPU the pool is sized from a token budget instead
    mem = f"{info['available_mem_gb']:.2f} GB" if runner.device.type == "cuda" else "n/a on the CPU"
    logger.info(
        "max_total_num_tokens=%d (KV pool %.2f GiB), chunked_prefill_size=%s, max_running_requests=%d, "
        "context_len=%d, available_mem=%s, overlap_schedule=%s",
        info["max_total_num_tokens"], kv_bytes / 2**30, cfg.chunked_prefill_size, cfg.max_running_requests,
        info["context_length"], mem, cfg.overlap,
    )  # fmt: skip
    return info


def _hierarchical_cache(args: EngineArgs, runner: Any, tree: Any, source: Any) -> Any:
    if not args.enable_hierarchical_cache:
        if args.hicache_storage_backend:
            raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache")
        return None
    if tree is None:
        raise ValueError("--enable-hierarchical-cache needs the radix cache (drop --disable-radix-cache)")
    from phloem.runtime.cache.hicache import build_hicache

    pool = runner.kv_pool
    model_id = (
        f"{source.kind}:{source.path}|{pool.dtype}|{pool.num_layers}x{pool.num_kv_heads}x{pool.head_dim}"
    )
    if source.kind == "dummy":
        model_id += f"|seed={args.random_seed}"
    return build_hicache(
        pool,
        tree,
        ratio=args.hicache_ratio,
        size_gb=args.hicache_size,
        write_policy=args.hicache_write_policy,
        storage_backend=args.hicache_storage_backend,
        storage_dir=args.hicache_storage_dir,
        prefetch_policy=args.hicache_storage_prefetch_policy,
        model_id=model_id,
    )


def _grammar_queue(args: EngineArgs, tokenizer: Any, runner: Any, eos: set[int]) -> Any:
    if args.grammar_backend == "none":
        return None
    from phloem.runtime.scheduler.grammar_queue import GrammarQueue

    automata = None
    if grammar_on_device(args, runner.device.type):
        from phloem.grammars.automaton import AutomatonTable

        rows = runner.req_to_token_pool.req_to_token.shape[0]
        automata = AutomatonTable(runner.vocab_size, rows, runner.device)
    return GrammarQueue(
        backend_name=args.grammar_backend,
        tokenizer=tokenizer,
        vocab_size=runner.vocab_size,
        stop_token_ids=eos,
        compile_timeout=args.grammar_compile_timeout,
        automata=automata,
        # chains follow forced text spelled the tokenizer's way (a state allowing one token)
        canonical_forced_text=switches.JUMP_FORWARD_DEVICE_SPELLING.flag()
        or getattr(runner, "chain_decoder", None) is not None,
    )


def grammar_on_device(args: EngineArgs, device_type: str) -> bool:
    """Whether regular grammars run as device automata: ``--grammar-on-device on``, or ``auto`` on
    CUDA. Never with speculative decoding, whose verify step masks a tree of drafts on the host."""
    if args.speculative_algorithm is not None or args.grammar_on_device == "off" or args.tp_size > 1:
        return False  # (tensor parallel: the automata's state would live on rank 0's device only)
    return args.grammar_on_device == "on" or device_type == "cuda"
