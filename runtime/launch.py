"""Spawns the scheduler and detokenizer processes, waits for them, and watches them.

``launch_engine`` is shared by ``phloem serve`` and the in-process ``Engine``: it resolves the
model, loads the tokenizer in this process, starts both children (spawn, never fork: torch and
ZMQ state must not be inherited), and returns a started ``TokenizerManager`` plus a handle that
shuts everything down. A watchdog marks the manager broken within about a second of a child's
death, or once the scheduler has sent no heartbeat for ``--watchdog-timeout`` seconds (a stopped or
frozen process cannot exit by itself), which fails every pending request with an error.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field, fields
from typing import Any

from phloem.runtime.config import EngineArgs
from phloem.runtime.ipc import IpcPaths
from phloem.runtime.tokenizer.manager import TokenizerManager

logger = logging.getLogger("phloem.launch")

WATCHDOG_INTERVAL_S = 0.5
TERM_GRACE_S = 2.0  # after SIGTERM, before SIGKILL (which a stopped process needs)


@dataclass
class EngineProcesses:
    ipc: IpcPaths
    procs: list[Any] = field(default_factory=list)

    def all_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def dead(self) -> list[str]:
        return [f"{p.name} (exit code {p.exitcode})" for p in self.procs if not p.is_alive()]

    def terminate(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` seconds in all for the children to exit (they were told to shut
        down), then SIGTERM the rest, then SIGKILL what still lives: a stopped (SIGSTOP) or frozen
        child never acts on SIGTERM, and must not outlive this process."""
        self._join_all(timeout)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        self._join_all(TERM_GRACE_S)
        for p in self.procs:
            if p.is_alive():
                logger.warning("%s (pid %s) did not exit; killing it", p.name, p.pid)
                p.kill()
                p.join(timeout=TERM_GRACE_S)
        self.ipc.cleanup()

    def _join_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))


def start_processes(args: EngineArgs, model_source: Any) -> EngineProcesses:
    from phloem.runtime.scheduler.process import run_scheduler_process
    from phloem.runtime.tokenizer.detokenizer_process import run_detokenizer_process

    ctx = mp.get_context("spawn")
    ipc = IpcPaths.fresh()
    me = os.getpid()
    args = with_rendezvous(args)
    sched = ctx.Process(
        target=run_scheduler_process, args=(args, ipc, me), name="phloem-scheduler", daemon=True
    )
    detok = ctx.Process(
        target=run_detokenizer_process,
        args=(model_source, ipc, me, args.log_level, args.tokenizer_path),
        name="phloem-detokenizer",
        daemon=True,
    )
    sched.start()
    detok.start()
    followers = start_followers(args, skip_rank_0=True)
    return EngineProcesses(ipc=ipc, procs=[sched, detok, *followers])


def with_rendezvous(args: EngineArgs) -> EngineArgs:
    """``args`` with a rendezvous address when tensor parallelism needs one and none was given (a
    free local port: one node)."""
    if args.tp_size == 1 or args.dist_init_addr is not None:
        return args
    from phloem.runtime.distributed.ranks import free_port

    return args.replace(dist_init_addr=f"127.0.0.1:{free_port()}")


def start_followers(args: EngineArgs, *, skip_rank_0: bool) -> list[Any]:
    """Spawn this node's tensor-parallel follower ranks (all but global rank 0)."""
    from phloem.runtime.distributed.ranks import node_ranks
    from phloem.runtime.scheduler.tp_follower import run_follower_process

    ctx = mp.get_context("spawn")
    procs = []
    for place in node_ranks(args.tp_size, args.nnodes, args.node_rank, args.base_gpu_id):
        if place.rank == 0 and skip_rank_0:
            continue
        p = ctx.Process(
            target=run_follower_process, args=(args, place, os.getpid()), name=f"phloem-tp-rank-{place.rank}",
            daemon=True,
        )  # fmt: skip
        p.start()
        procs.append(p)
    return procs


def run_follower_node(args: EngineArgs) -> int:
    """``phloem serve --nnodes K --node-rank r`` with r > 0: run this node's ranks (no HTTP server;
    node 0 serves) until they exit, or until interrupted."""
    check_supported(args)
    procs = EngineProcesses(ipc=IpcPaths.fresh(), procs=start_followers(args, skip_rank_0=False))
    logger.info("node %d of %d: %d tensor-parallel ranks started; node 0 serves", args.node_rank, args.nnodes,
                len(procs.procs))  # fmt: skip
    try:
        while procs.all_alive():
            time.sleep(WATCHDOG_INTERVAL_S)
    except KeyboardInterrupt:
        pass
    finally:
        procs.terminate(timeout=5)
    codes = [p.exitcode for p in procs.procs]
    return 0 if all(c == 0 for c in codes) else 1


async def launch_engine(args: EngineArgs) -> tuple[TokenizerManager, EngineProcesses]:
    """Start the children and a ``TokenizerManager`` on the running loop; wait until ready."""
    from phloem.runtime.model_files import resolve_model
    from phloem.runtime.tokenizer.tokenizer import load_tokenizer

    check_supported(args)
    source = resolve_model(args.model_path, args.load_format, dummy_shape=args.dummy_shape)
    tokenizer = load_tokenizer(source, args.tokenizer_path)
    procs = start_processes(args, source)
    model_info = {
        "model_path": str(source.path) if source.path else args.dummy_shape,
        "tokenizer_path": str(source.path) if source.path else None,
        "served_model_name": args.served_model_name or _default_name(source),
        "is_generation": True,
        "chat_template": tokenizer.chat_template,
        "eos_token_ids": sorted(tokenizer.eos_token_ids),
        "bos_token_id": tokenizer.bos_token_id,
        "vocab_size": tokenizer.vocab_size,
        "context_length": 0,
    }
    tm = TokenizerManager(args, tokenizer=tokenizer, ipc=procs.ipc, model_info=model_info)
    try:
        # context_length and vocab size come from the scheduler's Ready (it loaded the model).
        tm.context_len = 1 << 30
        await tm.start(children_alive=procs.all_alive)
    except BaseException:
        procs.terminate(timeout=1)
        raise
    info = tm.scheduler_info
    tm.context_len = int(info["context_length"])
    tm.vocab_size = int(info["vocab_size"])
    model_info.update(context_length=tm.context_len, vocab_size=tm.vocab_size)
    tm._tasks.append(asyncio.create_task(_watchdog(tm, procs)))
    return tm, procs


KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def check_supported(args: EngineArgs) -> None:
    """Options this build accepts on the command line but cannot honour fail here, loudly (before
    any child process starts)."""
    for f in fields(args):
        # the command line checks choices itself; ``Engine(**kwargs)`` arrives here unchecked
        choices = f.metadata.get("choices")
        value = getattr(args, f.name)
        if choices is not None and value not in choices:
            shown = ", ".join(str(c) for c in choices if c is not None)
            raise ValueError(f"--{f.name.replace('_', '-')} {value}: expected one of {shown}")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {args.kv_cache_dtype}: expected one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if args.kv_cache_dtype == "fp8_e4m3" and args.attention_backend == "flashinfer":
        raise ValueError(
            "--kv-cache-dtype fp8_e4m3 is not read by --attention-backend flashinfer; "
            "use triton or torch_ref (auto picks one of them)"
        )
    if args.num_continuous_decode_steps < 0:
        raise ValueError(
            f"--num-continuous-decode-steps must be >= 0 (0 = auto), got {args.num_continuous_decode_steps}"
        )
    if args.continuous_decode_budget_ms is not None and not args.continuous_decode_budget_ms >= 0:
        raise ValueError(
            f"--continuous-decode-budget-ms must be >= 0, got {args.continuous_decode_budget_ms}"
        )
    check_parallel(args)
    if args.dp_size > 1:  # one engine is one replica; replicas are processes behind the router
        raise ValueError(
            f"--dp-size {args.dp_size}: one engine is one replica; run 'phloem serve --dp-size {args.dp_size}' "
            "for several behind the router"
        )
    if not args.watchdog_timeout > 0:
        raise ValueError(f"--watchdog-timeout must be > 0 seconds, got {args.watchdog_timeout}")
    if args.mem_fraction_static is not None and not 0 < args.mem_fraction_static <= 1:
        raise ValueError(
            f"--mem-fraction-static is a fraction of the device's memory in (0, 1], got {args.mem_fraction_static}"
        )
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                "--device cuda: no CUDA device is visible to this torch build; use --device cpu (or auto)"
            )


def check_parallel(args: EngineArgs) -> None:
    """The parallelism flags describe a possible layout, or one line says which does not."""
    for name in ("tp_size", "dp_size", "nnodes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank}: expected 0 <= node rank < --nnodes {args.nnodes}")
    if args.base_gpu_id < 0:
        raise ValueError(f"--base-gpu-id must be >= 0, got {args.base_gpu_id}")
    from phloem.runtime.distributed.ranks import init_method, node_ranks

    node_ranks(args.tp_size, args.nnodes, args.node_rank)  # raises when --nnodes does not divide
    if args.nnodes > 1 and args.dist_init_addr is None:
        raise ValueError("--nnodes above 1 needs --dist-init-addr HOST:PORT (the same on every node)")
    if args.dist_init_addr is not None:
        init_method(args.dist_init_addr)  # raises on a malformed address
    if args.dp_size > 1 and (args.nnodes > 1 or args.dist_init_addr is not None):
        raise ValueError(
            "--dp-size runs its replicas on this machine, each with its own rendezvous: drop --nnodes and "
            "--dist-init-addr (for replicas on several machines, run phloem router --worker-urls ...)"
        )
    if args.tp_size > 1:
        for name, on in (
            ("--speculative-algorithm", args.speculative_algorithm is not None),
            ("--enable-hierarchical-cache", args.enable_hierarchical_cache),
        ):
            if on:
                raise ValueError(f"{name} is not available with --tp-size above 1")


async def _watchdog(tm: TokenizerManager, procs: EngineProcesses) -> None:
    """Mark the manager broken (it logs why) when a child died or the scheduler went silent."""
    while True:
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
        if tm.health() == "shutting_down":
            continue
        if not procs.all_alive():
            tm.mark_broken("child process died: " + ", ".join(procs.dead()))
            return
        lost = tm.heartbeat_lost()
        if lost:
            tm.mark_broken(f"the scheduler is hung: {lost}")
            return


def _default_name(source: Any) -> str:
    path = getattr(source, "path", None)
    if path is None:
        return "dummy"
    return os.path.basename(str(path)).removesuffix(".gguf")
