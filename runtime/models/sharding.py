"""How a decoder's attention heads and MLP split across tensor-parallel ranks.

Query heads split evenly: rank ``r`` of ``N`` holds query heads ``[r * Hq/N, (r + 1) * Hq/N)``,
so ``N`` must divide the query head count. KV heads follow their query heads:

- ``N <= Hkv``: ``N`` must divide ``Hkv``; rank ``r`` holds KV heads ``[r * Hkv/N, (r + 1) * Hkv/N)``,
  exactly those its query heads read (query head ``h`` reads KV head ``h // (Hq/Hkv)``).
- ``N > Hkv``: ``Hkv`` must divide ``N``; each rank holds one KV head, the one its query heads
  read, ``r // (N/Hkv)``: ``N/Hkv`` consecutive ranks hold copies of the same KV head.

Anything else is a one-line ``ValueError`` naming the constraint. The MLP's intermediate features
split evenly too (``N`` must divide them); the vocabulary is padded to a multiple of ``N``
(``layers/embedding.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from phloem.runtime.distributed.state import TPGroup, shard_range

if TYPE_CHECKING:
    from phloem.runtime.models.config import ModelConfig

__all__ = ["HeadShard", "head_shard", "per_rank_heads"]


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads: query heads ``[q_start, q_start + num_heads)`` and KV heads
    ``[kv_start, kv_start + num_kv_heads)`` of the full model."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int
    kv_copies: int = 1  # ranks holding a copy of this rank's KV heads (``N / Hkv`` when ``N > Hkv``)


def head_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    """Rank ``rank``'s heads among ``size`` ranks (see the module docstring).

    Raises
    ------
    ValueError
        When ``size`` fits neither rule; the message names ``--tp-size`` and the head count.
    """
    q_lo, q_hi = shard_range(num_heads, rank, size, what="attention heads")
    if size <= num_kv_heads:
        kv_lo, kv_hi = shard_range(num_kv_heads, rank, size, what="KV heads")
        return HeadShard(q_hi - q_lo, kv_hi - kv_lo, q_lo, kv_lo)
    if size % num_kv_heads:
        raise ValueError(
            f"--tp-size {size} is above the model's {num_kv_heads} KV heads and not a multiple of them"
        )
    replicas = size // num_kv_heads
    return HeadShard(q_hi - q_lo, 1, q_lo, rank // replicas, kv_copies=replicas)


def per_rank_heads(cfg: ModelConfig, tp: TPGroup) -> HeadShard:
    """:func:`head_shard` of ``cfg`` for this process's rank of ``tp``; also checks that ``tp``
    splits the MLP (one error, before any weight is read)."""
    shard = head_shard(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.size)
    shard_range(cfg.intermediate_size, tp.rank, tp.size, what="MLP intermediate features")
    return shard
