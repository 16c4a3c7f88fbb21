"""Where each tensor-parallel rank runs: its global rank, its node, its GPU, the rendezvous.

``--tp-size N --nnodes K``: the N ranks are spread evenly, N/K per node, in node order; global
rank ``node_rank * N/K + local``. Rank 0 (node 0) schedules and serves HTTP; the others follow.
On CUDA, a node's local rank ``l`` takes GPU ``--base-gpu-id + l``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

__all__ = ["RankPlace", "free_port", "init_method", "node_ranks", "rank_device"]


@dataclass(frozen=True)
class RankPlace:
    rank: int  # global rank in the tensor-parallel group
    size: int  # --tp-size
    local_rank: int  # index on this node
    gpu: int  # CUDA device index on this node (unused on the CPU)


def node_ranks(tp_size: int, nnodes: int, node_rank: int, base_gpu_id: int = 0) -> list[RankPlace]:
    """The ranks node ``node_rank`` runs, in order.

    Raises
    ------
    ValueError
        When ``nnodes`` does not divide ``tp_size`` (the message names both flags).
    """
    if tp_size % nnodes:
        raise ValueError(
            f"--nnodes {nnodes} does not divide --tp-size {tp_size}: each node runs the same number of ranks"
        )
    per_node = tp_size // nnodes
    return [
        RankPlace(rank=node_rank * per_node + local, size=tp_size, local_rank=local, gpu=base_gpu_id + local)
        for local in range(per_node)
    ]


def init_method(dist_init_addr: str) -> str:
    """torch.distributed rendezvous URL of ``HOST:PORT`` (IPv6 hosts in brackets).

    Raises
    ------
    ValueError
        When the port is missing or not a number.
    """
    host, sep, port = dist_init_addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr {dist_init_addr!r}: expected HOST:PORT")
    return f"tcp://{host}:{port}"


def free_port() -> int:
    """A TCP port free on this machine now (for a one-node rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_device(device: str, gpu: int) -> str:
    """The device string a rank computes on: ``cuda:<gpu>`` where CUDA is meant, else ``cpu``."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    return f"cuda:{gpu}"
