"""Give the device memory of the weights and the KV pool back, and take it again (colocated RL).

A trainer sharing the GPU with the engine asks it to release its memory while it trains, then to
resume. Every tensor object stays: only its storage is resized to zero bytes and later back, so
every module, view and backend that holds a weight or a KV buffer still holds the right tensor
afterwards. Weights are copied to host memory first (pinned on CUDA) and copied back into the same
storages; the KV pool's contents are dropped (the caller flushed the prefix cache) and its buffers
come back zeroed. Storage comes back at new device addresses, so the decode CUDA graphs, which
captured the old ones, are dropped on release (freeing their memory pool too) and captured again
once nothing is released; so are the short extend graphs and the chain decode graphs.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import Any

import torch
from phloem.runtime.messages import MEMORY_TAGS

__all__ = ["MemoryOccupation"]

logger = logging.getLogger("phloem.scheduler")


class MemoryOccupation:
    """Releases and resumes the memory of one ``ModelRunner`` by tag (``MEMORY_TAGS``)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.released: set[str] = set()
        self._weights: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # storage, host copy
        self._kv: list[tuple[torch.UntypedStorage, int]] = []  # storage, bytes it had

    def release(self, tags: Iterable[str]) -> str:
        todo = [t for t in _checked(tags) if t not in self.released]
        if not todo:
            return "nothing to release"
        self._drop_graphs()
        freed = 0
        for tag in todo:
            freed += self._release_weights() if tag == "weights" else self._release_kv()
            self.released.add(tag)
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()  # give the freed blocks back to the driver, for the trainer
        logger.info("released %s: %.1f MiB", ", ".join(todo), freed / 2**20)
        return f"released {', '.join(todo)} ({freed / 2**20:.1f} MiB)"

    def resume(self, tags: Iterable[str]) -> str:
        todo = [t for t in _checked(tags) if t in self.released]
        if not todo:
            return "nothing to resume"
        for tag in todo:
            self._resume_weights() if tag == "weights" else self._resume_kv()
            self.released.discard(tag)
        graphs = self.runner.cuda_graphs
        if graphs is not None and not self.released:
            graphs.capture()  # over the new addresses of the weights and the pool
            for extra in _extra_graphs(self.runner):
                extra.capture()
        logger.info("resumed %s", ", ".join(todo))
        return f"resumed {', '.join(todo)}"

    # ---- weights ------------------------------------------------------------------------------
    def _release_weights(self) -> int:
        pin = self.runner.device.type == "cuda"
        freed = 0
        for storage in _storages(itertools.chain(self.runner.model.parameters(), self.runner.model.buffers())):
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(_bytes(storage))
            freed += storage.nbytes()
            storage.resize_(0)
            self._weights.append((storage, host))
        return freed

    def _resume_weights(self) -> None:
        for storage, host in self._weights:
            storage.resize_(host.numel())
            _bytes(storage).copy_(host)
        self._weights = []

    # ---- KV pool ------------------------------------------------------------------------------
    def _release_kv(self) -> int:
        pool = self.runner.kv_pool
        freed = 0
        for storage in _storages([*pool.k_buffer, *pool.v_buffer]):
            freed += storage.nbytes()
            self._kv.append((storage, storage.nbytes()))
            storage.resize_(0)
        return freed

    def _resume_kv(self) -> None:
        for storage, nbytes in self._kv:
            storage.resize_(nbytes)
            _bytes(storage).zero_()  # as the pool was made (the padding slot is read before written)
        self._kv = []

    def _drop_graphs(self) -> None:
        graphs = self.runner.cuda_graphs
        if graphs is not None:
            graphs.graphs, graphs.logits, graphs.pool = {}, {}, None  # replays stop: can_run is False
        for extra in _extra_graphs(self.runner):
            extra.drop()


def _extra_graphs(runner: Any) -> list[Any]:
    """The runner's graph sets besides the decode graphs (short extends, chain decode)."""
    found = (getattr(runner, "extend_graphs", None), getattr(runner, "chain_decoder", None))
    return [g for g in found if g is not None]


def _checked(tags: Iterable[str]) -> list[str]:
    out = list(dict.fromkeys(tags))
    for tag in out:
        if tag not in MEMORY_TAGS:
            raise ValueError(f"unknown memory tag {tag!r}")
    return out


def _storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages under ``tensors`` that hold memory and can be resized (a tied
    embedding is one storage; a tensor made over numpy memory cannot be freed and is kept)."""
    seen: set[int] = set()
    out: list[torch.UntypedStorage] = []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or not storage.resizable() or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        out.append(storage)
    return out


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
