"""Host tier of the KV cache (docs/design.md §3, HiCache): a host-memory copy of the device pool's layout.

``HostKVPool`` holds, per layer, K and V tensors ``[num_slots, kv_heads, head_dim]`` in host memory
(pinned when the device pool is on CUDA), with its own slot allocator; slot 0 is never handed out,
as in the device pool. A copier moves tokens between the two pools:

    to_host:    host.k[l][host_slots] = device.k[l][dev_slots]   (and V), for every layer l
    to_device:  device.k[l][dev_slots] = host.k[l][host_slots]   (and V), for every layer l

``KVCopier`` (CPU) does both as plain indexed copies, done on return. ``CudaStreamCopier`` does
``to_host`` on a copy stream (done on return) and ``to_device`` in two halves (``LayerwiseLoader``):

    stage    scheduler thread, at admission    host slots -> a device staging buffer on the copy
                                               stream, layer by layer (DMA straight from the pinned
                                               host pool), one event per layer
    scatter  forward thread, in the pass of    right before attention of layer l: the compute stream
             the next batch launched           waits for layer l's event and copies staging -> the
                                               pool's slots (``LayerReadiness``, called from
                                               ``AttentionBackend.forward``)

so the copies overlap the batch before them and the first layers of their own. The model runner
registers the pool's loader; the worker hands each batch the loads staged since the previous batch
(``take``). Without a registered loader the copier scatters each load at once and waits for it: a
plain synchronous copy.

Streams, for a batch N+1 with a load while batch N may still run::

    copy     H2D layer 0 | H2D layer 1 | ... | H2D layer L-1        | D2H of a backup (waited for)
    compute  ... batch N ... | N+1: ... wait copied[l], scatter l, attention l, ... | record landed

Invariants:

- Pool slots are written only on the compute stream (forward passes and scatters), so a slot freed
  and handed out again is written in program order. A batch's scatter of layer l comes after every
  earlier batch and before anything the batch itself writes to layer l; a load staged for a request
  whose admission fell through rides with the next batch.
- The host pool is read by DMA on the copy stream and written by D2H copies on the same stream; the
  CPU writes into it only after ``wait_host_reads``.
- KV whose load has not landed is never read back to the host: ``landing`` tells the controller.
- Staging buffers and slot indices are allocated on the copy stream and read on the compute stream:
  ``record_stream`` keeps the caching allocator from reusing them before the compute stream is past
  them. Pinned host sources need nothing: the pinned-memory allocator records its own events.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .allocator import TokenSlotAllocator
from .kv_pool import FP8_DTYPES, KVPool

__all__ = [
    "CudaStreamCopier",
    "CudaStreams",
    "HostKVPool",
    "KVCopier",
    "KVLoad",
    "LayerReadiness",
    "LayerwiseLoader",
    "make_copier",
    "slot_runs",
]

# A copy straight between the host pool and the device moves one run of consecutive host slots per
# DMA call; when runs are shorter than this on average, the slots are gathered on the CPU first.
_MIN_MEAN_RUN = 64


class HostKVPool:
    """Per-layer K and V buffers in host memory plus the allocator of their slots.

    Parameters
    ----------
    num_layers, num_tokens, num_kv_heads, head_dim, dtype:
        Shape; ``num_tokens`` usable slots (slot 0 is extra and unused).
    pin_memory:
        Page-lock the buffers (for asynchronous copies to and from a CUDA device).
    check:
        Passed to the slot allocator (double-free detection, for tests).
    """

    def __init__(
        self,
        num_layers: int,
        num_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        pin_memory: bool = False,
        check: bool = False,
    ) -> None:
        if num_tokens < 1:
            raise ValueError(f"the host pool needs at least one token, got {num_tokens}")
        self.num_layers, self.num_slots = num_layers, num_tokens + 1
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (self.num_slots, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, pin_memory=pin_memory) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, pin_memory=pin_memory) for _ in range(num_layers)]
        self.allocator = TokenSlotAllocator(self.num_slots, check=check)

    @classmethod
    def like(cls, device_pool: KVPool, num_tokens: int, *, check: bool = False) -> HostKVPool:
        """A host pool with ``device_pool``'s layer shape and dtype, ``num_tokens`` slots."""
        return cls(
            device_pool.num_layers,
            num_tokens,
            device_pool.num_kv_heads,
            device_pool.head_dim,
            device_pool.dtype,
            pin_memory=device_pool.device.type == "cuda" and torch.cuda.is_available(),
            check=check,
        )

    @property
    def size(self) -> int:
        """Usable slots."""
        return self.allocator.total_size

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers."""
        return KVPool.bytes_per_token_for(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh copies of the K and V at ``slots``, each ``[layers, T, kv_heads, head_dim]``."""
        return (
            torch.stack([k[slots] for k in self.k_buffer]),
            torch.stack([v[slots] for v in self.v_buffer]),
        )

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` ``[layers, T, kv_heads, head_dim]`` at ``slots`` ``[T]`` (in place)."""
        for layer in range(self.num_layers):
            self.k_buffer[layer][slots] = k[layer].to(self.dtype)
            self.v_buffer[layer][slots] = v[layer].to(self.dtype)

    def gather(self, slots: torch.Tensor, *, pin_memory: bool = False) -> torch.Tensor:
        """K and V of ``slots`` as one fresh ``[layers, 2 (K, V), T, kv_heads, head_dim]`` tensor."""
        out = torch.empty(
            (self.num_layers, 2, slots.numel(), self.num_kv_heads, self.head_dim),
            dtype=self.dtype,
            pin_memory=pin_memory,
        )
        for layer in range(self.num_layers):
            torch.index_select(self.k_buffer[layer], 0, slots, out=out[layer, 0])
            torch.index_select(self.v_buffer[layer], 0, slots, out=out[layer, 1])
        return out


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slot numbers in ``slots`` (int64 ``[T]``, host), as
    ``(offset in slots, first slot, length)``: ``slots[off : off + n] == first + arange(n)``."""
    n = slots.numel()
    if n == 0:
        return []
    cuts = (torch.nonzero(slots[1:] != slots[:-1] + 1).flatten() + 1).tolist()
    starts, ends = [0, *cuts], [*cuts, n]
    return [(a, first, b - a) for a, b, first in zip(starts, ends, slots[starts].tolist())]


def _direct(runs: list[tuple[int, int, int]], n: int) -> bool:
    return len(runs) <= 1 or len(runs) * _MIN_MEAN_RUN <= n


def _host_to_device(slots: torch.Tensor, device: torch.device, *, pin: bool) -> torch.Tensor:
    """Slot indices on ``device``, copied on the current stream (from pinned memory: asynchronous)."""
    if slots.device.type == "cpu" and pin:
        slots = slots.pin_memory()
    return slots.to(device, non_blocking=True)


class KVCopier:
    """Copies tokens between a device ``KVPool`` and a ``HostKVPool``, layer by layer (CPU path).

    Both directions are done on return. The hooks below (``landing``, ``wait_host_reads``,
    ``reset``) matter only to copiers that leave copies in flight; here they do nothing.
    """

    def to_host(
        self, device: KVPool, dev_slots: torch.Tensor, host: HostKVPool, host_slots: torch.Tensor
    ) -> None:
        """Copy device ``dev_slots`` into host ``host_slots`` (both int64 ``[T]``). Done on return."""
        d = dev_slots.to(device.device)
        for layer in range(device.num_layers):
            host.k_buffer[layer][host_slots] = device.k_buffer[layer][d].to("cpu")
            host.v_buffer[layer][host_slots] = device.v_buffer[layer][d].to("cpu")

    def to_device(
        self, host: HostKVPool, host_slots: torch.Tensor, device: KVPool, dev_slots: torch.Tensor
    ) -> None:
        """Copy host ``host_slots`` into device ``dev_slots``. Visible to every later forward pass."""
        d = dev_slots.to(device.device)
        for layer in range(device.num_layers):
            device.k_buffer[layer][d] = host.k_buffer[layer][host_slots].to(device.device)
            device.v_buffer[layer][d] = host.v_buffer[layer][host_slots].to(device.device)

    def landing(self, dev_slots: torch.Tensor) -> bool:
        """Whether a copy into any of ``dev_slots`` may not have landed yet."""
        return False

    def wait_host_reads(self) -> None:
        """Block until no copy in flight reads host memory (call before the CPU writes the host pool)."""

    def reset(self) -> None:
        """Forget copies that no forward pass has started (the tree was flushed)."""


# ============================================================================ CUDA: layer-wise loads
class CudaStreams:
    """Where CUDA copies run: a copy stream beside the caller's current stream (the compute stream of
    whichever thread calls). Events are ``torch.cuda.Event``. Tests stand in an object with the same
    members that runs everything at once on the CPU and logs the order of events and waits."""

    pin_memory = True  # page-locked host buffers, so host <-> device copies are asynchronous

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy = torch.cuda.Stream(device)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        """Make ``stream`` the current stream inside the block."""
        return torch.cuda.stream(stream)

    def record(self, stream: Any) -> Any:
        """An event that fires once everything queued on ``stream`` so far is done."""
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_for_compute(self, stream: Any) -> None:
        """Work queued on ``stream`` from now on starts after everything queued on the current stream."""
        stream.wait_stream(torch.cuda.current_stream(self.device))

    def compute_waits(self, event: Any) -> None:
        """Work queued on the current stream from now on starts after ``event`` (the host goes on)."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, stream_or_event: Any) -> None:
        stream_or_event.synchronize()

    def record_use(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor`` (allocated on another stream) is used on ``stream``: keep its memory until then."""
        tensor.record_stream(stream)


@dataclass(eq=False)
class KVLoad:
    """One staged load: KV bound for the pool's ``slots``, waiting in ``staging`` on the device."""

    slots: torch.Tensor  # [T] int64, host: the pool slots it fills
    dev_slots: torch.Tensor  # the same, on the device
    staging: torch.Tensor | None  # [layers, 2 (K, V), T, kv_heads, head_dim]; None once scattered
    copied: list[Any]  # per layer: an event after its staging rows arrived (copy stream)
    landed: Any = None  # an event after its last scatter (compute stream)


class LayerReadiness:
    """The loads of one batch, scattered into the pool layer by layer as its forward pass gets there.

    ``wait(layer)``, right before attention of ``layer``: the compute stream waits for that layer's
    copies and scatters them into the pool (layers before it too, if nobody asked yet); the host does
    not block. ``finish()`` after the pass scatters what is left and marks the loads landed.
    """

    def __init__(self, pool: KVPool, loads: Sequence[KVLoad], streams: CudaStreams) -> None:
        self._pool, self._s = pool, streams
        self._staged: list[tuple[KVLoad, torch.Tensor]] = []
        compute = streams.current()
        for load in loads:
            if load.staging is None:
                raise RuntimeError("a KV load was started twice")
            streams.record_use(load.staging, compute)
            streams.record_use(load.dev_slots, compute)
            self._staged.append((load, load.staging))
        self._scattered = 0  # layers 0 .. _scattered - 1 are in the pool

    def wait(self, layer: int) -> None:
        layer = min(layer, self._pool.num_layers - 1)
        while self._scattered <= layer:
            now = self._scattered
            k_buf, v_buf = self._pool.get_kv(now)
            for load, staging in self._staged:
                self._s.compute_waits(load.copied[now])
                _raw(k_buf).index_copy_(0, load.dev_slots, _raw(staging[now, 0]))
                _raw(v_buf).index_copy_(0, load.dev_slots, _raw(staging[now, 1]))
            self._scattered += 1

    def wait_all(self) -> None:
        self.wait(self._pool.num_layers - 1)

    def finish(self) -> Any:
        """Scatter every layer not scattered yet; returns the event after the last scatter."""
        self.wait_all()
        landed = self._s.record(self._s.current())
        for load, _ in self._staged:
            load.staging, load.landed = None, landed
        self._staged = []
        return landed


class LayerwiseLoader:
    """Host -> device loads of one pool: staged at once, scattered by the forward pass that reads
    them (see the module docstring).

    Scheduler thread: ``stage``, ``take`` (when a batch is handed to the forward thread: the loads
    staged since the previous hand-off go with it), ``landing``, ``wait_host_reads``, ``reset``.
    Forward thread: ``start``, which touches only the loads it is given.
    """

    # id(pool) -> its loader, for as long as the loader lives (its owner holds it; it holds the pool,
    # so the id is not reused meanwhile)
    _registered: ClassVar[weakref.WeakValueDictionary[int, LayerwiseLoader]] = weakref.WeakValueDictionary()

    def __init__(self, pool: KVPool, *, streams: CudaStreams | None = None) -> None:
        self.pool = pool
        self.streams = streams if streams is not None else CudaStreams(pool.device)
        self._pending: list[KVLoad] = []  # staged, not handed to a batch yet
        self._unlanded: list[KVLoad] = []  # staged, not known to be in the pool yet

    @classmethod
    def register(cls, pool: KVPool, *, streams: CudaStreams | None = None) -> LayerwiseLoader:
        """A loader for ``pool`` whose loads its owner (the model runner) starts in its forward
        passes; a copier made for ``pool`` from now on defers its loads to it."""
        loader = cls(pool, streams=streams)
        cls._registered[id(pool)] = loader
        return loader

    @classmethod
    def registered(cls, pool: KVPool) -> LayerwiseLoader | None:
        loader = cls._registered.get(id(pool))
        return loader if loader is not None and loader.pool is pool else None

    # ------------------------------------------------------------------ scheduler thread
    def stage(self, host: HostKVPool, host_slots: torch.Tensor, dev_slots: torch.Tensor) -> KVLoad:
        """Start copying host ``host_slots`` into a staging buffer bound for pool ``dev_slots`` (both
        int64 ``[T]``, host) and queue the load for the next ``take``. The pool is not touched yet."""
        s, pool = self.streams, self.pool
        n = host_slots.numel()
        runs = slot_runs(host_slots)
        gathered = None if _direct(runs, n) else host.gather(host_slots, pin_memory=s.pin_memory)
        slots = dev_slots.detach().reshape(-1).to("cpu", torch.int64).clone()
        with s.on(s.copy):
            on_device = _host_to_device(slots, pool.device, pin=s.pin_memory)
            shape = (pool.num_layers, 2, n, pool.num_kv_heads, pool.head_dim)
            staging = torch.empty(shape, dtype=pool.dtype, device=pool.device)
            copied = []
            for layer in range(pool.num_layers):
                dst = staging[layer]  # [2, T, kv_heads, head_dim]
                if gathered is not None:
                    dst.copy_(gathered[layer], non_blocking=True)
                else:  # one DMA per run of consecutive host slots
                    for i, buf in enumerate((host.k_buffer[layer], host.v_buffer[layer])):
                        for off, first, n_run in runs:
                            dst[i, off : off + n_run].copy_(buf[first : first + n_run], non_blocking=True)
                copied.append(s.record(s.copy))
        load = KVLoad(slots=slots, dev_slots=on_device, staging=staging, copied=copied)
        self._pending.append(load)
        self._unlanded.append(load)
        return load

    def take(self) -> list[KVLoad]:
        """The loads staged since the last ``take``: they go with the batch handed over now."""
        loads, self._pending = self._pending, []
        return loads

    def landing(self, slots: torch.Tensor) -> bool:
        """Whether a load into any of pool ``slots`` (int64, host) may not have landed yet."""
        done = self.streams.done
        self._unlanded = [x for x in self._unlanded if x.landed is None or not done(x.landed)]
        return any(bool(torch.isin(x.slots, slots).any()) for x in self._unlanded)

    def wait_host_reads(self) -> None:
        """Block until every staged copy has read its host slots."""
        self.streams.synchronize(self.streams.copy)

    def reset(self) -> None:
        """Drop loads not handed to a batch (their staging memory was used on the copy stream only)."""
        self._pending.clear()
        self._unlanded = [x for x in self._unlanded if x.landed is not None]

    # ------------------------------------------------------------------ forward thread
    def start(self, loads: Sequence[KVLoad]) -> LayerReadiness:
        """The readiness of ``loads`` for the forward pass about to run on the current stream: its
        attention layers scatter them (``LayerReadiness.wait``); ``finish`` once the model ran."""
        return LayerReadiness(self.pool, loads, self.streams)


class CudaStreamCopier(KVCopier):
    """Copies between a CUDA pool and a pinned host pool on side streams (see the module docstring).

    Parameters
    ----------
    loader:
        The pool's loader (its streams are the copier's).
    deferred:
        ``True`` when a model runner starts the loads in its forward passes (``loader`` is the one it
        registered); ``False``: ``to_device`` starts each load itself and returns once it landed.
    """

    def __init__(self, loader: LayerwiseLoader, *, deferred: bool) -> None:
        self.loader = loader
        self.deferred = deferred

    def to_host(
        self, device: KVPool, dev_slots: torch.Tensor, host: HostKVPool, host_slots: torch.Tensor
    ) -> None:
        s = self.loader.streams
        n = host_slots.numel()
        runs = slot_runs(host_slots)
        shape = (device.num_layers, 2, n, device.num_kv_heads, device.head_dim)
        bounce = None if _direct(runs, n) else torch.empty(shape, dtype=host.dtype, pin_memory=s.pin_memory)
        if not self.deferred:
            # Nothing orders this caller's writes for us: copy after everything it queued. With a
            # model runner the engine only backs up tree nodes, whose forward pass has been waited
            # for already; waiting here would stall the scheduler until the batch in flight ends.
            s.wait_for_compute(s.copy)
        with s.on(s.copy):
            d = _host_to_device(dev_slots, device.device, pin=s.pin_memory)
            for layer in range(device.num_layers):
                for i, (src, dst) in enumerate(_k_and_v(device, host, layer)):
                    rows = _raw(src).index_select(0, d).view(src.dtype)  # [T, kv_heads, head_dim], contiguous
                    if bounce is not None:
                        bounce[layer, i].copy_(rows, non_blocking=True)
                        continue
                    for off, first, n_run in runs:
                        dst[first : first + n_run].copy_(rows[off : off + n_run], non_blocking=True)
        s.synchronize(s.copy)
        if bounce is not None:
            for layer in range(device.num_layers):
                _raw(host.k_buffer[layer]).index_copy_(0, host_slots, _raw(bounce[layer, 0]))
                _raw(host.v_buffer[layer]).index_copy_(0, host_slots, _raw(bounce[layer, 1]))

    def to_device(
        self, host: HostKVPool, host_slots: torch.Tensor, device: KVPool, dev_slots: torch.Tensor
    ) -> None:
        """Stage the load; with a registered loader the next batch's forward pass lands it, else it
        lands before this returns."""
        self.loader.stage(host, host_slots, dev_slots)
        if not self.deferred:
            self.loader.streams.synchronize(self.loader.start(self.loader.take()).finish())

    def landing(self, dev_slots: torch.Tensor) -> bool:
        return self.loader.landing(dev_slots)

    def wait_host_reads(self) -> None:
        self.loader.wait_host_reads()

    def reset(self) -> None:
        self.loader.reset()


def _raw(buf: torch.Tensor) -> torch.Tensor:
    """``buf`` as bytes when it is fp8 (same shape): ``index_copy_`` has no float8 kernel on the CPU
    or CUDA in the torch versions we run, and these copies move stored values untouched anyway."""
    return buf.view(torch.uint8) if buf.dtype in FP8_DTYPES else buf


def _k_and_v(device: KVPool, host: HostKVPool, layer: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """``(device K, host K), (device V, host V)`` buffers of ``layer``."""
    return (device.k_buffer[layer], host.k_buffer[layer]), (device.v_buffer[layer], host.v_buffer[layer])


def make_copier(device_pool: KVPool) -> KVCopier:
    """The copier for ``device_pool``'s device, chosen once: plain copies on the CPU; on CUDA,
    layer-wise loads when the pool's model runner registered a loader, synchronous ones otherwise."""
    if device_pool.device.type != "cuda":
        return KVCopier()
    registered = LayerwiseLoader.registered(device_pool)
    if registered is not None:
        return CudaStreamCopier(registered, deferred=True)
    return CudaStreamCopier(LayerwiseLoader(device_pool), deferred=False)
