"""Handing tensors to the engine's processes through a file in shared memory.

``Engine.update_weights_from_tensor`` writes the tensors as one safetensors file (plain arrays: no
code runs when it is read, and no pickle crosses the process boundary) to a RAM-backed folder
(``/dev/shm`` on Linux), and sends only its path; the scheduler reads it from memory, not disk.
Where there is no such folder the system's temporary folder serves. The file is removed when the
caller is done with it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator

import torch

__all__ = ["SHM_DIR", "shared_dir", "shared_safetensors"]

SHM_DIR = "/dev/shm"


def shared_dir() -> str | None:
    """A writable RAM-backed folder, or ``None`` (then the system's temporary folder is used)."""
    return SHM_DIR if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else None


@contextlib.contextmanager
def shared_safetensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[str]:
    """Write ``named_tensors`` as a safetensors file in shared memory; yields its path and removes
    the file afterwards. Each tensor is written from its own contiguous CPU copy (safetensors
    refuses views that share storage)."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in named_tensors}
    fd, path = tempfile.mkstemp(prefix="phloem-tensors-", suffix=".safetensors", dir=shared_dir())
    os.close(fd)
    try:
        save_file(tensors, path)
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
