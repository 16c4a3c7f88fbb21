"""Device-side KV storage (docs/design.md §3): one slot per token, addressed through ``req_to_token``.

``KVPool`` holds, per layer, K and V tensors ``[num_slots, kv_heads, head_dim]``. Slot 0 is the
padding slot: padded rows of a batch write there and it is never handed out by the allocator.
``ReqToTokenPool`` maps ``(request row, position) -> slot``; requests sharing a prefix hold the
same slot numbers in their rows.

fp8 storage (``--kv-cache-dtype fp8_e4m3``): the buffers are ``torch.float8_e4m3fn`` (one byte per
element, so twice the tokens fit in the same memory) with one float32 scale per layer for K and one
for V (per-tensor scales)::

    stored = fp8(clamp(x / scale, -448, 448))        read = stored.to(compute dtype) * scale

The scales default to 1.0, as in SGLang and vLLM without calibration: e4m3 spans +-448, which
holds typical K/V activations. ``get_kv`` returns the raw buffers; readers dequantize with
``get_kv_scales`` (or gather through ``gather_kv``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["FP8_DTYPES", "FP8_E4M3_MAX", "PADDING_SLOT", "KVPool", "ReqToTokenPool"]

PADDING_SLOT = 0
FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_E4M3_MAX = 448.0  # largest finite e4m3fn value; larger values would cast to NaN


class KVPool:
    """Per-layer K and V buffers.

    Parameters
    ----------
    num_layers, num_slots, num_kv_heads, head_dim:
        Shape; ``num_slots`` includes the padding slot 0, so ``num_slots - 1`` tokens fit.
    dtype, device:
        Storage dtype and device. ``torch.float8_e4m3fn`` stores scaled fp8 (module docstring).
    k_scales, v_scales:
        fp8 pools only: one positive scale per layer (a sequence or a ``[num_layers]`` tensor);
        default 1.0 for every layer.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        k_scales: Sequence[float] | torch.Tensor | None = None,
        v_scales: Sequence[float] | torch.Tensor | None = None,
    ) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is padding), got {num_slots}")
        self.num_layers, self.num_slots = num_layers, num_slots
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.k_scales = _layer_scales(k_scales, num_layers, dtype, "k_scales")  # [layers] float32, host
        self.v_scales = _layer_scales(v_scales, num_layers, dtype, "v_scales")
        # Python floats for the per-layer hot path: no device sync, and a plain kernel argument.
        self._k_scale, self._v_scale = self.k_scales.tolist(), self.v_scales.tolist()
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def size(self) -> int:
        """Usable slots (padding slot excluded)."""
        return self.num_slots - 1

    @property
    def is_fp8(self) -> bool:
        """Whether the buffers hold scaled fp8 that readers must dequantize."""
        return self.dtype in FP8_DTYPES

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers."""
        return self.bytes_per_token_for(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @staticmethod
    def bytes_per_token_for(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """``kv_heads x head_dim x 2 (K and V) x layers x dtype size`` (1 byte for fp8)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_kv_heads * head_dim * 2 * num_layers * itemsize

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v`` ``[T, kv_heads, head_dim]`` at ``slots`` ``[T]`` of ``layer`` (in place)."""
        if not self.is_fp8:
            self.k_buffer[layer][slots] = k.to(self.dtype)
            self.v_buffer[layer][slots] = v.to(self.dtype)
            return
        # Scatter the bytes: uint8 indexing has a kernel on every device and torch version.
        self.k_buffer[layer].view(torch.uint8)[slots] = self._quantize(k, self._k_scale[layer])
        self.v_buffer[layer].view(torch.uint8)[slots] = self._quantize(v, self._v_scale[layer])

    def _quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """``fp8(clamp(x / scale, -448, 448))`` as raw bytes; the clamp keeps outliers finite."""
        if scale != 1.0:
            x = x.float() / scale
        return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(self.dtype).view(torch.uint8)

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K and V buffers of ``layer`` (views, valid until the pool is freed).

        Raw storage: for an fp8 pool, multiply by :meth:`get_kv_scales` after converting.
        """
        return self.k_buffer[layer], self.v_buffer[layer]

    def get_kv_scales(self, layer: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of ``layer``: stored value x scale = real value (1.0 unless fp8)."""
        return self._k_scale[layer], self._v_scale[layer]

    def gather_kv(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (any index shape ``[...]``) as fresh ``[..., kv_heads, head_dim]``
        tensors of ``dtype``, dequantized; for non-fp8 pools exactly ``buffer[slots].to(dtype)``."""
        k_scale, v_scale = self.get_kv_scales(layer)
        return (
            _dequantize(_rows(self.k_buffer[layer], slots), k_scale, dtype),
            _dequantize(_rows(self.v_buffer[layer], slots), v_scale, dtype),
        )


def _rows(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``buf[slots]``; fp8 rows are gathered as bytes (like ``set_kv`` scatters them)."""
    if buf.dtype not in FP8_DTYPES:
        return buf[slots]
    return buf.view(torch.uint8)[slots].view(buf.dtype)


def _dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    x = x.to(dtype)
    return x if scale == 1.0 else x * scale


def _layer_scales(
    scales: Sequence[float] | torch.Tensor | None, num_layers: int, dtype: torch.dtype, name: str
) -> torch.Tensor:
    """``[num_layers]`` float32 on the host; 1.0 everywhere when ``scales`` is ``None``."""
    if scales is None:
        return torch.ones(num_layers, dtype=torch.float32)
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{name} need an fp8 pool; got dtype {dtype}")
    out = torch.as_tensor(scales, dtype=torch.float32).detach().to("cpu").reshape(-1).clone()
    if out.numel() != num_layers:
        raise ValueError(f"{name} has {out.numel()} values for {num_layers} layers")
    if not bool(torch.isfinite(out).all() and (out > 0).all()):
        raise ValueError(f"{name} must be finite and positive, got {out.tolist()}")
    return out


class ReqToTokenPool:
    """Rows of ``req_to_token`` ``[size, max_context_len]`` (int64), one row per running request.

    Rows are handed out by :meth:`alloc` and returned by :meth:`free`; a row's content is owned by
    the scheduler/cache manager, which writes slot numbers into it before each forward.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        self.size, self.max_context_len = size, max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self._free_rows = list(range(size - 1, -1, -1))  # pop() hands out row 0 first

    @property
    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row index, or ``None`` when all rows are in use."""
        return self._free_rows.pop() if self._free_rows else None

    def free(self, idx: int) -> None:
        """Return row ``idx``; its content is left as is and must not be read afterwards."""
        if not 0 <= idx < self.size:
            raise ValueError(f"row {idx} is outside the pool of {self.size}")
        self._free_rows.append(idx)

    def clear(self) -> None:
        """Free every row."""
        self._free_rows = list(range(self.size - 1, -1, -1))
