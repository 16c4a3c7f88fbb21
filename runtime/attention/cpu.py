"""The CPU attention backend: :class:`TorchRefBackend` with decode in one C++ call per layer.

A decode step on a small model is dominated by per-op overhead, not arithmetic: the reference
decode spends about 30 torch ops a layer (RoPE, the pool write, two gathers of every request's
K/V into a padded block, mask, transposes, SDPA). ``cpu_decode_kernels.h`` does the same work
in one call that reads K/V in place through ``req_to_token``. RoPE and the pool write are bit for
bit the reference's; the softmax sums in another order than SDPA, so outputs agree to float32
rounding (``tests/unit/test_cpu_attention.py``). Prefill, verify, fp8 pools and q/k norms take
the reference path.
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

__all__ = ["CpuBackend"]


class CpuBackend(TorchRefBackend):
    """See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kernels: Any = cpu_kernels() if self.kv_pool.dtype == torch.float32 else None
        self._fast = False

    def init_metadata(self, forward_input: ForwardInput) -> None:
        fi = forward_input
        self._fast = self._kernels is not None and fi.mode == ForwardMode.DECODE
        if not self._fast:
            super().init_metadata(fi)
            return
        self.mode = fi.mode
        self.out_slots = fi.out_slots
        self._req = fi.req_pool_indices
        self._seq_lens = fi.seq_lens

    def decode_tables(self) -> tuple[torch.Tensor, ...] | None:
        """``(out_slots, req_to_token, req_pool_indices, seq_lens)`` of this decode batch when every
        layer can take the one-call decode (the whole-step path, ``models/cpu_decode.py``), else
        ``None``."""
        if not self._fast or self.layer_ready is not None:
            return None
        return self.out_slots, self.req_to_token_pool.req_to_token, self._req, self._seq_lens

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        if (
            not self._fast
            or cos_sin is None
            or qk_norm is not None
            or q.dtype != torch.float32
            or q.shape[-1] % 8
        ):
            if self._fast:  # a layer the kernel does not cover: plan the reference decode once
                self._fast = False
                super()._init_decode(self.req_to_token_pool.req_to_token[self._req], self._seq_lens)
            return super().forward(q, k, v, layer, cos_sin, qk_norm)
        if self.layer_ready is not None:
            self.layer_ready.wait(layer)
        k_buf, v_buf = self.kv_pool.get_kv(layer)
        cos, sin = cos_sin
        return self._kernels.decode_attention(
            q, k, v, k_buf, v_buf, self.out_slots, self.req_to_token_pool.req_to_token, self._req,
            self._seq_lens, cos, sin, self.scale,
        )  # fmt: skip
