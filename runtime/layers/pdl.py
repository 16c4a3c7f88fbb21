"""Programmatic dependent launch (PDL) for the decode-step kernels, on Hopper GPUs and later.

A small-batch decode step is a chain of a few hundred short kernels. Between two of them the GPU
lets the first drain completely, then launches the second and brings its programs up: a few
microseconds a boundary, idle. With PDL the next kernel is launched while the current
one still runs; its programs become resident, may read what no kernel of the step writes (the
weights), and then wait for the previous kernel to finish and its writes to land. Each kernel
taking part, compiled with ``PDL=True`` and launched with :func:`launch_kwargs`:

- calls ``gdc_launch_dependents()`` first thing: the next kernel may launch once every program of
  this one has started;
- calls ``gdc_wait()`` in every program before its first access to memory that an earlier kernel
  writes or reads (activations, the KV pool, scratch, its own outputs); only weight loads may
  come before it.

Ordering stays transitive: a kernel's wait returns after the previous kernel completed, which
happened after every program of that kernel had returned from its own wait. A kernel launched
without the attribute (torch, cuBLAS, copies) waits for its predecessor as usual, and one that
follows it starts only when it ends.

``PHLOEM_PDL=0`` turns it off (read on first use); :func:`set_pdl` does the same in the process,
before any graph is captured. Off on GPUs before Hopper, on the CPU and under the interpreter.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from phloem.runtime import switches

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: pdl_enabled() stays False, the jitted branches never run
    gdc_launch_dependents = gdc_wait = None

__all__ = ["launch_kwargs", "pdl_enabled", "pdl_trigger", "pdl_wait", "set_pdl"]

ENV = switches.PDL.name
_switch: bool | None = None  # None: read the environment on first use
_capable: dict[int, bool] = {}  # device index -> compute capability >= 9.0


def set_pdl(enabled: bool) -> None:
    """Use PDL for the decode kernels (where the GPU supports it) or not."""
    global _switch
    _switch = bool(enabled)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` should use PDL."""
    global _switch
    if _switch is None:
        _switch = switches.PDL.flag() and not switches.TRITON_INTERPRET.flag()
    if not _switch or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _capable.get(index)
    if ok is None:
        ok = _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9 and _has_gdc()
    return ok


def launch_kwargs(pdl: bool) -> dict[str, Any]:
    """Extra launch options for a kernel compiled with ``PDL=pdl``."""
    return {"launch_pdl": True} if pdl else {}


def _has_gdc() -> bool:
    return gdc_wait is not None


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has started (a no-op without PDL)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible (a no-op without PDL)."""
    if PDL:
        gdc_wait()
