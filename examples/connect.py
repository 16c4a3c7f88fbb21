"""Where the examples run: an in-process Engine (the default), our server by URL, or a given backend.

Each example's ``main(target=None)`` accepts ``None`` (start an Engine for the run), a server URL such
as ``http://127.0.0.1:30000``, or a ready :class:`phloem.Backend`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

import phloem as ph

Target = ph.Backend | str | None


@contextmanager
def connect(target: Target = None) -> Iterator[ph.Backend]:
    """Yield a backend for ``target``; an Engine started here is shut down on exit."""
    if isinstance(target, ph.Backend):
        yield target
        return
    if isinstance(target, str):
        backend = ph.RuntimeEndpoint(target)
        try:
            yield backend
        finally:
            backend.close()
        return
    from phloem import Engine

    engine = Engine(log_level="warning")
    try:
        yield ph.EngineBackend(engine)
    finally:
        engine.shutdown()


@contextmanager
def served(url: str | None = None, *, timeout: float = 180.0) -> Iterator[str]:
    """Yield ``url``; without one, start ``python -m phloem serve`` on a free port for the block."""
    if url is not None:
        yield url
        return
    import socket
    import subprocess
    import sys
    import time

    import requests

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "phloem", "serve", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"phloem serve exited with {proc.returncode}")
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                if time.time() > deadline:
                    raise
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def cli_target(description: str) -> str | None:
    """``--url`` from the command line (``None``: an in-process Engine)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default=None, help="a running `phloem serve`, e.g. http://127.0.0.1:30000")
    return parser.parse_args().url
