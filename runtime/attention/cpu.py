"""The CPU attention backend: :class:`TorchRefBackend` with decode in one C++ call per layer.

A decode step on a small model is dominated by per-op overhead, not arithmetic: the reference
decode spends about 30 torch ops a layer (RoPE, the pool write, two gathers of every request's
K/V into a padded block, mask, transposes, SDPA). ``cpu_decode_kernels.h`` does the same work
in one call that reads K/V in place through ``req_to_token``. RoPE and the pool write are bit for
bit the reference's; the softmax sums in another order than SDPA, so outputs agree to float32
rounding (``tests/unit/test_cpu_attention.py``). Prefill, fp8 pools, head sizes that are not a
multiple of 8 and q/k norms take the reference path. Verify passes on the CPU take the same
kernel through :class:`CpuRowsAttention` (``speculative/verify.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from phloem.runtime.attention.base import QKNorm
from phloem.runtime.attention.torch_ref import TorchRefBackend
from phloem.runtime.forward_io import ForwardMode
from phloem.runtime.layers.cpu_ops import cpu_kernels

if TYPE_CHECKING:
    from phloem.runtime.forward_io import ForwardInput

__all__ = ["CpuBackend", "CpuRowsAttention", "decodes_in_rows"]


class CpuRowsAttention:
    """Mixin: a pass's attention as decode rows through the one-call kernel
    (``layers/cpu_decode_kernels.h``): row ``t`` writes its K/V at ``out_slots[t]``, then attends
    over the slots ``table[req[t], 0 : lens[t]]``, read in place.

    A decode batch is one row per request (:class:`CpuBackend`). A verify pass is one row per draft
    node whose keys are its request's prefix, then its ancestors and itself, root first
    (``speculative/verify.py``, ``executor/verify_graph.py``): the key sequence plain decoding reads for
    that token, so every node is computed bit for bit as plain decoding computes it. Subclasses set
    ``_tables = (out_slots, table, req, lens)`` when they plan a pass; :meth:`decode_tables` hands
    them to the whole-step decode (``models/cpu_decode.py``). A layer the kernel does not cover (q/k
    norms, no RoPE tables) calls :meth:`_leave_rows`, and the rest of the pass takes the base class's
    reference path.
    """

    _tables: tuple[torch.Tensor, ...] | None = None

    def decode_tables(self) -> tuple[torch.Tensor, ...] | None:
        """``(out_slots, table, req, lens)`` when every layer of this pass can take the kernel."""
        return self._tables if self.layer_ready is None else None  # type: ignore[attr-defined]

    def _leave_rows(self) -> None:
        """Prepare the reference path for the rest of this pass (the base class's plan)."""
        self._tables = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        tables = self._tables
        if tables is None or cos_sin is None or qk_norm is not None or q.dtype != torch.float32:
            if tables is not None:
                self._leave_rows()
            return super().forward(q, k, v, layer, cos_sin, qk_norm)  # type: ignore[misc]
        if self.layer_ready is not None:  # type: ignore[attr-defined]
            self.layer_ready.wait(layer)  # type: ignore[attr-defined]
        k_buf, v_buf = self.kv_pool.get_kv(layer)  # type: ignore[attr-defined]
        out_slots, table, req, lens = tables
        cos, sin = cos_sin
        return cpu_kernels().decode_attention(
            q, k, v, k_buf, v_buf, out_slots, table, req, lens, cos, sin, self.scale  # type: ignore[attr-defined]
        )  # fmt: skip


class CpuBackend(CpuRowsAttention, TorchRefBackend):
    """See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        pool = self.kv_pool
        covered = pool.dtype == torch.float32 and pool.head_dim % 8 == 0
        self._kernels: Any = cpu_kernels() if covered else None

    def init_metadata(self, forward_input: ForwardInput) -> None:
        fi = forward_input
        if self._kernels is None or fi.mode != ForwardMode.DECODE:
            self._tables = None
            super().init_metadata(fi)
            return
        self.mode = fi.mode
        self.out_slots = fi.out_slots
        self._tables = (fi.out_slots, self.req_to_token_pool.req_to_token, fi.req_pool_indices, fi.seq_lens)

    def _leave_rows(self) -> None:
        assert self._tables is not None
        _, table, req, lens = self._tables
        self._init_decode(table[req], lens)  # the reference decode, planned once for the pass
        self._tables = None


def decodes_in_rows(runner: Any) -> bool:
    """Whether ``runner`` decodes through :class:`CpuBackend`'s kernel, so its verify passes should
    too (greedy speculative output then equals plain greedy output bit for bit)."""
    backend = getattr(runner, "attn_backend", None)
    return isinstance(backend, CpuBackend) and backend._kernels is not None
