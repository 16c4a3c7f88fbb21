"""``phloem serve --dp-size N``: N ``phloem serve`` workers on free local ports, the router in front.

Each worker is the same command with ``--dp-size 1``, its own port on 127.0.0.1 and, on CUDA, its
own GPUs (``--base-gpu-id base + i * tp_size``). The router serves on ``--host``/``--port`` once
every worker is healthy. Workers never outlive this process: SIGTERM/SIGINT stops the router, then
the workers; and each worker is started with a parent-death signal (Linux), so even a killed
router takes its workers with it.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import sys
import time
from typing import Any

from phloem.runtime.config import EngineArgs
from phloem.runtime.router.config import RouterArgs

logger = logging.getLogger("phloem.router")

READY_TIMEOUT_S = 1800.0  # large models load for minutes
STOP_GRACE_S = 20.0
# Each worker's own options; the router holds the public address.
_NOT_PASSED = ("host", "port", "dp_size", "base_gpu_id")


def worker_argv(args: EngineArgs, port: int, index: int) -> list[str]:
    """The ``phloem serve`` command of worker ``index``: every option that differs from its default."""
    argv = [sys.executable, "-m", "phloem", "serve"]
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if f.name in _NOT_PASSED or value == f.default or value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    gpu = args.base_gpu_id + index * args.tp_size
    return argv + ["--host", "127.0.0.1", "--port", str(port), "--base-gpu-id", str(gpu)]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:  # not Linux: the stop below still runs on a signal or a normal exit
        pass


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Workers:
    def __init__(self, args: EngineArgs) -> None:
        self.ports = [_free_port() for _ in range(args.dp_size)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        # a worker's stdout (its own "serving at" line) goes to stderr with its logs: stdout
        # announces the one address clients use
        self.procs = [
            subprocess.Popen(worker_argv(args, port, i), preexec_fn=preexec, stdout=sys.stderr)
            for i, port in enumerate(self.ports)
        ]

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until every worker answers ``/health`` with 200; ``RuntimeError`` when one exits."""
        import requests

        pending = dict(zip(self.urls, self.procs))
        deadline = time.monotonic() + timeout
        while pending:
            for url, proc in list(pending.items()):
                if proc.poll() is not None:
                    raise RuntimeError(f"worker {url} exited with code {proc.returncode} while starting")
                try:
                    if requests.get(url + "/health", timeout=2).status_code == 200:
                        del pending[url]
                except requests.RequestException:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not healthy after {timeout:.0f} s: {', '.join(pending)}")
            time.sleep(0.5)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("worker pid %d did not exit; killing it", p.pid)
                p.kill()
                p.wait()


def _raise_on_signal(sig: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_data_parallel(args: EngineArgs) -> int:
    """Start the workers, serve the router until a signal, stop the workers; the exit code."""
    from phloem.runtime.launch import check_parallel
    from phloem.runtime.router.app import run_router
    from phloem.runtime.server.app import check_port_free

    check_parallel(args)
    check_port_free(args.host, args.port)  # before any worker loads the model
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(message)s")
    previous = signal.signal(signal.SIGTERM, _raise_on_signal)  # while starting: stop the workers too
    workers = Workers(args)
    try:
        logger.info("starting %d workers: %s", args.dp_size, " ".join(workers.urls))
        try:
            workers.wait_ready()
        except RuntimeError as exc:
            print(f"phloem serve: error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
        signal.signal(signal.SIGTERM, previous)  # uvicorn's own handlers take over
        router = RouterArgs(
            worker_urls=tuple(workers.urls),
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            log_level=args.log_level,
        )
        return run_router(router, announce="phloem serving at")
    finally:
        signal.signal(signal.SIGTERM, previous)
        workers.stop()
