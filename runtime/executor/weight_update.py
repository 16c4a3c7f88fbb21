"""Replacing a loaded model's weights in place (the ``/update_weights_from_*`` routes).

An update never swaps tensors: every new value is copied into the tensor the model already holds
(same storage, dtype and device), so CUDA graphs captured over those tensors stay valid. It is
all-or-nothing: every name and shape is checked before the first copy, and a refused update leaves
the weights as they were.

Refusals a client can fix raise :class:`phloem.runtime.errors.InvalidRequest` naming the request
field (``model_path``, ``load_format``, ``tensor_file``, ``safetensors_b64``). Nothing here reads
pickled data: tensors arrive as safetensors (a file or its bytes), which hold plain arrays only.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.models.config import ModelConfig
from safetensors import SafetensorError
from torch import nn

__all__ = [
    "DISK_LOAD_FORMATS",
    "UNREADABLE",
    "CopyPlan",
    "check_load_format",
    "check_same_architecture",
    "model_tensors",
    "plan_full_copy",
    "plan_named_copy",
    "read_safetensors_bytes",
    "read_safetensors_file",
    "weight_values",
]

DISK_LOAD_FORMATS = ("auto", "gguf", "safetensors")
# What reading a damaged or foreign checkpoint raises: the client's file, not an engine fault.
UNREADABLE = (OSError, ValueError, KeyError, struct.error, SafetensorError)
# a config field that may differ: the runner keeps its own context length
_IGNORED_FIELDS = ("context_len",)
# what phloem.runtime.layers.rotary reads of a Llama-3 ``rope_scaling``
_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class CopyPlan:
    """Checked pairs ``(destination, source)``; :meth:`apply` copies them all."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]

    def apply(self) -> None:
        with torch.no_grad():
            for dst, src in self.pairs:
                dst.copy_(src)  # casts to the destination's dtype and device

    def __len__(self) -> int:
        return len(self.pairs)


def check_load_format(load_format: str | None) -> str:
    """``load_format`` of a disk update (``None`` means ``auto``); anything else is refused."""
    value = "auto" if load_format is None else load_format
    if value not in DISK_LOAD_FORMATS:
        raise InvalidRequest(
            "load_format", f"{value!r} is not supported here; expected one of {', '.join(DISK_LOAD_FORMATS)}"
        )
    return value


def check_same_architecture(current: ModelConfig, new: ModelConfig, field: str = "model_path") -> None:
    """Refuse a checkpoint whose architecture differs from the loaded one: every config field but
    the context length, floats to a relative 1e-6 (GGUF stores ``rms_norm_eps`` and the like in
    float32), and of ``rope_scaling`` the values the rotary embedding reads."""
    for f in fields(ModelConfig):
        if f.name in _IGNORED_FIELDS:
            continue
        a, b = getattr(current, f.name), getattr(new, f.name)
        if f.name == "rope_scaling":
            a, b = _rope_values(a), _rope_values(b)
        if not _same(a, b):
            raise InvalidRequest(
                field, f"a different architecture: {f.name} is {b!r} there and {a!r} in the loaded model"
            )


def _rope_values(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if scaling is None else {k: scaling.get(k) for k in _ROPE_KEYS}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-6)
    return bool(a == b)


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor an update may write, by name: the parameters and the quantized layers' blocks
    (``...quant.qs`` and so on). Constant buffers (RoPE tables) are left out."""
    from phloem.runtime.layers.quant import QuantizedWeight

    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    for prefix, module in model.named_modules():
        if isinstance(module, QuantizedWeight):
            for name, buf in module.named_buffers(recurse=False):
                out[f"{prefix}.{name}"] = buf
    return out


def plan_full_copy(
    target: Mapping[str, torch.Tensor], source: Mapping[str, torch.Tensor], field: str
) -> CopyPlan:
    """Pair every tensor of ``target`` with the one of the same name in ``source`` (both from
    :func:`model_tensors`); refuse a missing or extra name or a different shape."""
    missing = sorted(set(target) - set(source))
    extra = sorted(set(source) - set(target))
    if missing or extra:
        raise InvalidRequest(
            field, f"tensors differ from the loaded model: missing {missing[:4]}, extra {extra[:4]}"
        )
    for name, dst in target.items():
        if source[name].shape != dst.shape:
            raise InvalidRequest(
                field, f"{name}: shape {tuple(source[name].shape)} does not match {tuple(dst.shape)}"
            )
    return CopyPlan([(dst, source[name]) for name, dst in target.items()])


def plan_named_copy(model: Any, tensors: Mapping[str, torch.Tensor], field: str) -> CopyPlan:
    """Pair each checkpoint tensor (Hugging Face names, any subset of the model's) with where it
    lands (``model.checkpoint_target``); refuse an empty update, an unknown or quantized name, a
    shape mismatch or integer data for a float tensor before anything is written."""
    if not tensors:
        raise InvalidRequest(field, "no tensors given")
    pairs = []
    for name, src in tensors.items():
        try:
            dst = model.checkpoint_target(name)
        except KeyError as e:
            raise InvalidRequest(field, str(e.args[0]) if e.args else name) from None
        if src.shape != dst.shape:
            raise InvalidRequest(field, f"{name}: shape {tuple(src.shape)} does not match {tuple(dst.shape)}")
        if not (src.is_floating_point() or src.dtype == dst.dtype):
            raise InvalidRequest(field, f"{name}: dtype {src.dtype} cannot be copied into {dst.dtype}")
        pairs.append((dst, src))
    return CopyPlan(pairs)


def read_safetensors_bytes(data: bytes, field: str) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file held in memory (a format of plain arrays: no code runs)."""
    from safetensors.torch import load

    try:
        return load(data)
    except UNREADABLE as e:
        raise InvalidRequest(field, f"not a readable safetensors file: {e}") from None


def read_safetensors_file(path: str, field: str) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file on the engine's disk."""
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise InvalidRequest(field, f"no such file: {path}")
    try:
        return load_file(path)
    except UNREADABLE as e:
        raise InvalidRequest(field, f"not a readable safetensors file: {e}") from None


def weight_values(model: Any, name: str, truncate_size: int) -> list[Any]:
    """The first ``truncate_size`` rows (along dim 0) of the weight that checkpoint tensor ``name``
    (a Hugging Face name, as updates take them) lands in, as nested lists of floats: a fused
    q/k/v or gate/up projection gives the rows of that part. Refusals name ``name`` or
    ``truncate_size``."""
    if truncate_size < 0:
        raise InvalidRequest("truncate_size", f"{truncate_size}: must be >= 0")
    try:
        target = model.checkpoint_target(name)
    except KeyError as e:
        raise InvalidRequest("name", str(e.args[0]) if e.args else name) from None
    return target[:truncate_size].detach().to("cpu", torch.float32).tolist()
