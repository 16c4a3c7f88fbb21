"""Storage tier of the KV cache (HiCache): KV pages on a shared medium, keyed by their token prefix.

A page is ``page_size`` consecutive tokens starting at a multiple of ``page_size``. Its key is a
chain hash over everything before and in it, so equal keys mean equal prefixes::

    h[-1] = blake2b(namespace)                 namespace = model identity + extra_key
    h[i]  = blake2b(h[i-1] || tokens[i*P : (i+1)*P] as little-endian int64)

Only full pages are stored. ``FileKVStorage`` keeps one file per page::

    DIR/<model hash>/<key[:2]>/<key>.kv
    b"PHKVPAGE" | u32 header length | JSON header | payload (K then V, [layers, P, kv_heads, head_dim])

The header names the key, shape, dtype, payload size and a blake2b checksum of the payload; a file
whose header, size or checksum does not match is counted, deleted and treated as missing, never
served. Writes go through one background thread (write to a temporary name, then rename); reads are
synchronous and meant to run on a prefetch thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
from abc import ABC, abstractmethod
from array import array
from collections.abc import Sequence

import torch

__all__ = ["FileKVStorage", "KVStorage", "STORAGE_BACKENDS", "page_hashes"]

logger = logging.getLogger("phloem.cache")

_MAGIC = b"PHKVPAGE"
_VERSION = 1


def page_hashes(
    tokens: Sequence[int], *, page_size: int, namespace: str, limit: int | None = None
) -> list[str]:
    """Keys of the full pages of ``tokens`` (at most ``limit`` of them), in order."""
    n = len(tokens) // page_size if limit is None else min(len(tokens) // page_size, limit)
    h = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    keys = []
    for i in range(n):
        page = array("q", tokens[i * page_size : (i + 1) * page_size]).tobytes()
        h = hashlib.blake2b(h + page, digest_size=16).digest()
        keys.append(h.hex())
    return keys


class KVStorage(ABC):
    """A store of KV pages. ``exists`` and ``put`` are called from the scheduler thread, ``get``
    from prefetch threads; implementations are thread-safe for that split."""

    page_size: int

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a page is known to be stored (a later ``get`` may still find it corrupt)."""

    @abstractmethod
    def put(self, key: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a page asynchronously; ``k``/``v`` ``[layers, P, kv_heads, head_dim]`` are owned by
        the store from now on (the caller must not write them)."""

    @abstractmethod
    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Read and verify a page; ``None`` when missing or corrupt."""

    def wait_writes(self, timeout: float | None = None) -> bool:
        """Block until queued writes are on the medium (True) or ``timeout`` passes (False)."""
        return True

    def stats(self) -> dict[str, int]:
        """Counters (pages and bytes read and written, corrupt pages found)."""
        return {}

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Finish queued writes and release resources."""


class FileKVStorage(KVStorage):
    """Pages as files under ``root`` (see the module docstring).

    Parameters
    ----------
    root:
        Directory shared by engines of the same model; created if missing.
    model_id:
        Model identity (weights, dtype, shape): pages of other models live in other folders.
    num_layers, num_kv_heads, head_dim, dtype:
        Page shape, checked on every read.
    page_size:
        Tokens per page.
    """

    def __init__(
        self,
        root: str,
        *,
        model_id: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        page_size: int = 64,
    ) -> None:
        self.page_size = page_size
        self.model_id = model_id
        self.dir = os.path.join(root, hashlib.blake2b(model_id.encode(), digest_size=8).hexdigest())
        os.makedirs(self.dir, exist_ok=True)
        self._shape = (num_layers, page_size, num_kv_heads, head_dim)
        self._dtype = dtype
        self._dtype_name = str(dtype).removeprefix("torch.")
        self._page_bytes = (
            2 * torch.empty(self._shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        )
        self._index: set[str] = set(self._scan())
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._counters = {"pages_written": 0, "bytes_written": 0, "pages_read": 0, "bytes_read": 0,
                          "corrupt_pages": 0, "write_errors": 0}  # fmt: skip
        self._queue: queue.Queue[tuple[str, torch.Tensor, torch.Tensor] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-storage-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ KVStorage
    def exists(self, key: str) -> bool:
        return key in self._index

    def put(self, key: str, k: torch.Tensor, v: torch.Tensor) -> None:
        if key in self._index or key in self._pending:
            return
        if tuple(k.shape) != self._shape or tuple(v.shape) != self._shape:
            raise ValueError(f"page shape {tuple(k.shape)} != {self._shape}")
        self._pending.add(key)
        self._queue.put((key, k, v))

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except OSError:
            self._index.discard(key)
            return None
        page = self._decode(key, blob)
        if page is None:
            self._count("corrupt_pages", 1)
            self._index.discard(key)
            logger.warning("KV storage page %s is corrupt or truncated; ignored and removed", key)
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        self._count("pages_read", 1)
        self._count("bytes_read", self._page_bytes)
        return page

    def wait_writes(self, timeout: float | None = None) -> bool:
        done = threading.Event()

        def waiter() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=waiter, daemon=True).start()
        return done.wait(timeout)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._counters, "pages_stored": len(self._index), "pages_pending": len(self._pending)}

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=30)

    # ------------------------------------------------------------------ files
    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key[:2], key + ".kv")

    def _scan(self) -> list[str]:
        keys: list[str] = []
        for sub in os.listdir(self.dir):
            folder = os.path.join(self.dir, sub)
            if os.path.isdir(folder):
                keys.extend(name[:-3] for name in os.listdir(folder) if name.endswith(".kv"))
        return keys

    def _encode(self, key: str, k: torch.Tensor, v: torch.Tensor) -> bytes:
        payload = _raw(k) + _raw(v)
        header = json.dumps({
            "version": _VERSION, "key": key, "shape": list(self._shape), "dtype": self._dtype_name,
            "payload_bytes": len(payload), "checksum": hashlib.blake2b(payload, digest_size=16).hexdigest(),
        }).encode()  # fmt: skip
        return _MAGIC + struct.pack("<I", len(header)) + header + payload

    def _decode(self, key: str, blob: bytes) -> tuple[torch.Tensor, torch.Tensor] | None:
        try:
            if blob[:8] != _MAGIC:
                return None
            (hlen,) = struct.unpack("<I", blob[8:12])
            header = json.loads(blob[12 : 12 + hlen])
            payload = blob[12 + hlen :]
            ok = (
                header.get("version") == _VERSION
                and header.get("key") == key
                and tuple(header.get("shape", ())) == self._shape
                and header.get("dtype") == self._dtype_name
                and header.get("payload_bytes") == len(payload) == self._page_bytes
                and header.get("checksum") == hashlib.blake2b(payload, digest_size=16).hexdigest()
            )
        except (ValueError, struct.error, UnicodeDecodeError):
            return None
        if not ok:
            return None
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self._dtype)
        k, v = flat.view(2, *self._shape).unbind(0)
        return k, v

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, k, v = item
                self._write(key, k, v)
            finally:
                self._queue.task_done()

    def _write(self, key: str, k: torch.Tensor, v: torch.Tensor) -> None:
        path = self._path(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(self._encode(key, k, v))
            os.replace(tmp, path)
        except OSError as e:
            self._count("write_errors", 1)
            logger.warning("KV storage write of %s failed: %s", key, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
        else:
            self._index.add(key)
            self._count("pages_written", 1)
            self._count("bytes_written", self._page_bytes)
        finally:
            self._pending.discard(key)

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self._counters[name] += n


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


STORAGE_BACKENDS = {"file": FileKVStorage}
