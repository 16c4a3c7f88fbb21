"""Builds the CPU C++ kernels of this package on first use (``torch.utils.cpp_extension``; torch
caches the build on disk), once per process, and reports ``None`` where they cannot be built."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

__all__ = ["build_extension"]

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
            _built[name] = load(name, [path], extra_cflags=flags, extra_ldflags=["-fopenmp"])
        except Exception as exc:
            logger.warning("CPU kernels %s unavailable: %s", name, exc)
        return _built[name]
