"""Process groups over which a trainer broadcasts new weights (``/init_weights_update_group``,
``/update_weights_from_distributed``).

The trainer is rank 0 and hosts the rendezvous store (a ``TCPStore`` at ``master_address:
master_port``); the engine's scheduler joins as rank ``rank_offset``. The group is built directly
from the store (``ProcessGroupGloo`` or ``ProcessGroupNCCL``), not through
``torch.distributed.init_process_group``: the engine and the trainer are independent jobs, and a
default group in the scheduler process would tie it to one trainer for good. The store keys are
laid out as those of a group that a trainer written for SGLang builds (a ``tcp://`` rendezvous,
the store prefixed with the group's name, then torch's named-group helper, which adds
``<group_name>/<device>/``, ``cpu`` for gloo, ``cuda`` for nccl), so such a trainer needs no
change; a new one may build its side with :func:`join_group` as rank 0 and broadcast with
:meth:`WeightGroup.send`.

An update is checked against the model (names, shapes, dtypes) before anything is received, since
a refused update must not leave the trainer's broadcast half-consumed. Tensors arrive in new
buffers and are copied into the weights afterwards by the usual all-or-nothing plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from phloem.runtime.errors import InvalidRequest

__all__ = [
    "BACKENDS",
    "GROUP_TIMEOUT_S",
    "TensorSpec",
    "WeightGroup",
    "check_broadcast_update",
    "check_group_request",
    "join_group",
    "parse_dtype",
]

BACKENDS = ("gloo", "nccl")
# How long joining or one broadcast may wait for the other ranks before it fails.
GROUP_TIMEOUT_S = 300.0
# dtypes a broadcast tensor may have: the copy into the weights casts between float types only
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a broadcast update: its checkpoint name and what to receive it as."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class WeightGroup:
    """A joined group: this process's rank in it and where received tensors are placed."""

    name: str
    backend: str
    rank: int
    world_size: int
    pg: Any  # ProcessGroupGloo or ProcessGroupNCCL
    device: torch.device
    store: Any = field(repr=False)  # kept alive as long as the group: rank 0 serves it

    def receive(self, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
        """Receive each tensor of ``specs``, in order, broadcast by rank 0 into a new buffer."""
        out: dict[str, torch.Tensor] = {}
        for spec in specs:
            buf = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
            self._broadcast(buf)
            out[spec.name] = buf
        if self.device.type == "cuda":
            # received on this thread's stream: done before another thread's stream copies them
            torch.cuda.synchronize(self.device)
        return out

    def send(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast ``tensors`` in order from this rank (the trainer's side, rank 0)."""
        for t in tensors:
            self._broadcast(t.detach().to(self.device).contiguous())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        """Leave the group (NCCL communicators are freed; gloo's sockets close with the object)."""
        shutdown = getattr(self.pg, "shutdown", None)
        if self.backend == "nccl" and shutdown is not None:
            shutdown()
        self.pg = None


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    *,
    device: torch.device | str | None = None,
    timeout_s: float = GROUP_TIMEOUT_S,
) -> WeightGroup:
    """Join (rank 0: create) the group; blocks until all ``world_size`` ranks have joined.

    ``device``: where received tensors go (default: the CPU for gloo, the current CUDA device for
    nccl).
    """
    import torch.distributed as dist

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    kind = "cuda" if backend == "nccl" else "cpu"
    prefixed = dist.PrefixStore(f"{kind}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    pg: Any
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    group = WeightGroup(group_name, backend, rank, world_size, pg, torch.device(device), store)
    if backend == "nccl":
        # NCCL connects lazily; a first collective here makes joining fail or succeed now
        group._broadcast(torch.zeros(1, device=group.device))
    return group


def check_group_request(
    master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str,
    device: torch.device,
) -> None:
    """Refuse, naming the field, a join that cannot work on this engine (``device``: the model's)."""
    if not master_address:
        raise InvalidRequest("master_address", "must not be empty")
    if not 0 < master_port < 65536:
        raise InvalidRequest("master_port", f"{master_port} is not a TCP port")
    if world_size < 2:
        raise InvalidRequest("world_size", f"{world_size}: the group holds the trainer (rank 0) and the server")
    if not 0 < rank_offset < world_size:
        raise InvalidRequest("rank_offset", f"{rank_offset}: must be in 1..{world_size - 1} (rank 0 is the trainer)")
    if not group_name:
        raise InvalidRequest("group_name", "must not be empty")
    if backend not in BACKENDS:
        raise InvalidRequest("backend", f"{backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "nccl" and device.type != "cuda":
        raise InvalidRequest("backend", "nccl needs the model on a CUDA device; this engine runs on the CPU: use gloo")


def parse_dtype(name: str, field: str = "dtypes") -> torch.dtype:
    """A float dtype by name (``bfloat16`` or ``torch.bfloat16``)."""
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise InvalidRequest(field, f"{name!r} is not supported; expected one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


def check_broadcast_update(
    model: Any, names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> list[TensorSpec]:
    """What to receive for an update, checked against ``model`` before any byte is received:
    every name must land somewhere (``model.checkpoint_target``) with the same shape. Refusals
    name ``names``, ``dtypes`` or ``shapes``."""
    if not names:
        raise InvalidRequest("names", "no tensors given")
    if len(dtypes) != len(names):
        raise InvalidRequest("dtypes", f"{len(dtypes)} dtypes for {len(names)} names")
    if len(shapes) != len(names):
        raise InvalidRequest("shapes", f"{len(shapes)} shapes for {len(names)} names")
    seen: set[str] = set()
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if name in seen:
            raise InvalidRequest("names", f"{name} is given twice")
        seen.add(name)
        try:
            dst = model.checkpoint_target(name)
        except KeyError as e:
            raise InvalidRequest("names", str(e.args[0]) if e.args else name) from None
        if tuple(shape) != tuple(dst.shape):
            raise InvalidRequest("shapes", f"{name}: shape {tuple(shape)} does not match {tuple(dst.shape)}")
        specs.append(TensorSpec(name, parse_dtype(dtype), tuple(dst.shape)))
    return specs
