"""A tensor-parallel follower rank's process: load this rank's shard, then run rank 0's steps.

Started by the launcher next to rank 0's scheduler process (``--tp-size N`` on one node), or alone
on a further node (``phloem serve --nnodes K --node-rank r``, r > 0), which runs only followers and
no HTTP server. A follower exits when rank 0 sends the stop, when the process that started it is
gone, or when a collective fails (a peer died); the launcher then sees a dead child.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from typing import Any

from phloem.runtime.config import EngineArgs
from phloem.runtime.distributed.ranks import RankPlace, rank_device

__all__ = ["run_follower_process"]

logger = logging.getLogger("phloem.tp")


def run_follower_process(args: EngineArgs, place: RankPlace, parent_pid: int) -> None:
    logging.basicConfig(
        level=args.log_level.upper(), format=f"[%(asctime)s tp rank {place.rank}] %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent shuts us down in order
    _exit_with_parent(parent_pid)
    try:
        _follow(args, place)
    except Exception:
        logger.error("rank %d failed:\n%s", place.rank, traceback.format_exc())
        os._exit(1)  # a rank that left its group must not linger in it


def _follow(args: EngineArgs, place: RankPlace) -> None:
    import torch
    from phloem.runtime.distributed.ranks import init_method
    from phloem.runtime.distributed.state import destroy_tp, init_tp
    from phloem.runtime.executor.tp_step import follow
    from phloem.runtime.model_files import resolve_model
    from phloem.runtime.scheduler.builder import model_runner

    assert args.dist_init_addr is not None, "the launcher sets the rendezvous address"
    device = rank_device(args.device, place.gpu)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    torch.manual_seed(args.random_seed)
    tp = init_tp(rank=place.rank, size=place.size, init_method=init_method(args.dist_init_addr),
                 device=torch.device(device))  # fmt: skip
    source = resolve_model(args.model_path, args.load_format, dummy_shape=args.dummy_shape)
    runner: Any = model_runner(args.replace(device=device), source)
    logger.info("rank %d of %d ready on %s", place.rank, place.size, device)
    follow(tp, runner)
    destroy_tp()


def _exit_with_parent(parent_pid: int) -> None:
    """A follower blocks inside collectives; a thread ends it once its parent is gone."""
    from phloem.runtime.ipc import parent_alive

    def watch() -> None:
        while parent_alive(parent_pid):
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="phloem-parent-watch", daemon=True).start()
