"""Builds the CPU C++ kernels of this package on first use (``torch.utils.cpp_extension``; torch
caches the build on disk), once per process, and reports ``None`` where they cannot be built.

``python -m phloem.runtime.layers.cpu_build`` builds every extension this CPU can run, all at
once: a fresh checkout's first users (a test run, a server) then load them instead of compiling
each in turn (about half a minute apiece). Concurrent builds of one extension are safe: torch
holds a lock file in its build folder while it builds.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["build_all", "build_extension"]

logger = logging.getLogger(__name__)

_built: dict[str, Any] = {}  # extension name -> module, or None where the build failed
_lock = threading.Lock()


def build_extension(name: str, source: str, flags: list[str]) -> Any:
    """The extension ``name`` compiled from ``source`` (a file next to this module) with ``flags``,
    or ``None`` (no compiler, no ninja, a flag the compiler lacks, ...)."""
    with _lock:
        if name in _built:
            return _built[name]
        _built[name] = None
        try:
            from torch.utils.cpp_extension import load

            path = os.path.join(os.path.dirname(os.path.abspath(__file__)), source)
            # torch's build cache keys on the source file alone: name the build after the headers
            # it includes too, so an edited header is never served from a stale build
            tag = f"{name}_{_digest(path)[:10]}"
            _built[name] = load(tag, [path], extra_cflags=flags, extra_ldflags=["-fopenmp"])
        except Exception as exc:
            logger.warning("CPU kernels %s unavailable: %s", name, exc)
        return _built[name]


def _digest(path: str, seen: set[str] | None = None) -> str:
    """sha256 of ``path`` and of the local headers it includes (``#include "x.h"``), recursively."""
    seen = set() if seen is None else seen
    seen.add(path)
    with open(path, "rb") as f:
        text = f.read()
    h = hashlib.sha256(text)
    for inc in re.findall(rb'#include "([^"]+)"', text):
        dep = os.path.join(os.path.dirname(path), inc.decode())
        if dep not in seen and os.path.exists(dep):
            h.update(_digest(dep, seen).encode())
    return h.hexdigest()


def _jobs() -> dict[str, Callable[[], Any]]:
    """Every extension this CPU can run: name -> what builds (and loads) it."""
    from phloem.runtime.layers import cpu_ops, qdot, quant

    jobs: dict[str, Callable[[], Any]] = {
        f"qdot_{isa}": functools.partial(qdot.build_kernels, isa) for isa in qdot.supported_isas()
    }
    jobs["cpu_decode"] = cpu_ops.cpu_kernels
    jobs["quant"] = quant.kernels_available
    return jobs


def build_all() -> dict[str, bool]:
    """Build every extension this CPU can run, one process each, all at once (torch builds one
    extension at a time within a process); name -> whether it built."""
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "phloem.runtime.layers.cpu_build", "--one", name])
        for name in _jobs()
    }
    return {name: proc.wait() == 0 for name, proc in procs.items()}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        sys.exit(0 if _jobs()[sys.argv[2]]() else 1)
    print(build_all())
