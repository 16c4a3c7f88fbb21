"""GGUF weights: dequantize once, rename to Hugging Face names, cache as safetensors.

Dequantizing the default model takes a few seconds, so the float32 result is cached under
:func:`phloem.runtime.model_files.gguf_cache_dir` (keyed by path, size and mtime) together with
the derived :class:`ModelConfig`; later loads memory-map the cache. A tensor-parallel rank
(:func:`load_gguf_slices`) reads only its rows or columns of each cached tensor.

llama.cpp stores Llama's Q and K projections with the rows of each head permuted for its
interleaved RoPE; :func:`unpermute_rope_rows` restores the Hugging Face (rotate-half) order.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
from collections.abc import Iterator

import numpy as np
import torch
from phloem.runtime.distributed.slices import LazySlice
from phloem.runtime.model_files import GGUFFile, GGUFTensorInfo, gguf_cache_dir, read_gguf
from phloem.runtime.models.config import ModelConfig

__all__ = [
    "Q4Blocks",
    "gguf_block_types",
    "gguf_config",
    "gguf_model_config",
    "load_gguf_q4_blocks",
    "load_gguf_q8_blocks",
    "load_gguf_slices",
    "load_gguf_weights",
    "unpermute_rope_rows",
]

_WEIGHTS_FILE, _CONFIG_FILE = "weights.safetensors", "model_config.json"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """Hugging Face name of a GGUF tensor, or ``None`` for tensors the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of a Q or K projection (weight or bias).

    llama.cpp writes, per head, rows ``[0, D/2, 1, D/2+1, ...]`` (pairs interleaved); HF keeps
    ``[0..D/2) | [D/2..D)``.
    """
    rows = w.shape[0]
    head_dim = rows // num_heads
    rest = w.shape[1:]
    x = w.reshape(num_heads, head_dim // 2, 2, *rest)  # [heads, D/2, pair, ...]
    return x.transpose(1, 2).reshape(rows, *rest)  # [heads, pair, D/2, ...] -> [rows, ...]


def gguf_model_config(g: GGUFFile) -> ModelConfig:
    """:class:`ModelConfig` from a parsed GGUF file."""
    md = dict(g.metadata)
    md["phloem.tensor_names"] = {t.name for t in g.tensors}
    return ModelConfig.from_gguf_metadata(md)


def load_gguf_weights(path: str, *, use_cache: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and float32 weights (HF names) of a GGUF model, from the cache when possible.

    Parameters
    ----------
    path:
        The ``.gguf`` file.
    use_cache:
        Read and write the dequantized-weights cache.

    Returns
    -------
    (ModelConfig, dict[str, torch.Tensor])
    """
    from safetensors.torch import load_file

    folder = gguf_cache_dir(path)
    weights_path, config_path = os.path.join(folder, _WEIGHTS_FILE), os.path.join(folder, _CONFIG_FILE)
    if use_cache and os.path.exists(weights_path) and os.path.exists(config_path):
        with open(config_path) as f:
            cfg = ModelConfig(**json.load(f))
        return cfg, load_file(weights_path)
    g = read_gguf(path)
    cfg = gguf_model_config(g)
    tensors = dict(_dequantize_all(g, cfg))
    if use_cache:
        _write_cache(folder, cfg, tensors)
    return cfg, tensors


def gguf_config(path: str) -> ModelConfig:
    """The :class:`ModelConfig` of a GGUF model, from the cache or the file's metadata (no tensor
    is read)."""
    config_path = os.path.join(gguf_cache_dir(path), _CONFIG_FILE)
    if os.path.exists(config_path):
        with open(config_path) as f:
            return ModelConfig(**json.load(f))
    return gguf_model_config(read_gguf(path))


def load_gguf_slices(path: str) -> dict[str, LazySlice]:
    """Lazy slices (HF names) of a GGUF model's dequantized cache, for a tensor-parallel rank:
    indexing one reads only the rows or columns asked for, so a rank never reads the whole model.

    Ranks start together and may all find the cache missing. The first to take the cache
    folder's lock dequantizes and writes it (holding the whole model this once, as one rank
    does); the others wait on the lock and then find it written, instead of each dequantizing
    the model. The lock is a ``flock``: if the writer dies, the OS releases it, the next rank
    sees no cache and writes it, so nobody waits forever; and the write itself is atomic, so no
    rank ever reads half a cache.
    """
    from safetensors import safe_open

    folder = gguf_cache_dir(path)
    weights_path, config_path = os.path.join(folder, _WEIGHTS_FILE), os.path.join(folder, _CONFIG_FILE)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".write.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (os.path.exists(weights_path) and os.path.exists(config_path)):
            g = read_gguf(path)
            cfg = gguf_model_config(g)
            _write_cache(folder, cfg, dict(_dequantize_all(g, cfg)))
    with safe_open(weights_path, framework="pt") as f:  # a slice keeps the file mapped after close
        return {name: f.get_slice(name) for name in f.keys()}


def _dequantize_all(g: GGUFFile, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    data = np.memmap(g.path, dtype=np.uint8, mode="r")
    heads = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads}
    for info in g.tensors:
        name = hf_name(info.name)
        if name is None:
            continue
        arr = np.ascontiguousarray(_dequantize(data, info), dtype=np.float32)
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        proj = name.rsplit(".", 1)[0].split(".", 3)[-1]
        if cfg.arch == "llama" and proj in heads:
            w = unpermute_rope_rows(w, heads[proj])
        yield name, w.contiguous()


def load_gguf_q4_blocks(
    path: str, cfg: ModelConfig, *, lazy: bool = False
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | dict[str, Q4Blocks]:
    """The Q4_1 tensors of a GGUF file as raw blocks, by Hugging Face name (no dequantization).

    A Q4_1 block of 32 weights is ``d: f16, m: f16, qs: 16 bytes`` (low nibbles hold elements
    0..15, high nibbles 16..31). Returns ``name -> (qs uint8 [N, K/2], d float32 [N, K/32],
    m float32 [N, K/32])`` with Q/K rows in Hugging Face order, as :func:`load_gguf_weights` gives.
    ``lazy``: ``name -> Q4Blocks`` instead, which reads from the file only the rows or columns a
    tensor-parallel rank asks for.
    """
    from gguf import GGMLQuantizationType

    g = read_gguf(path)
    data = np.memmap(g.path, dtype=np.uint8, mode="r")
    heads = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads}
    lazy_out, out = {}, {}
    for info in g.tensors:
        name = hf_name(info.name)
        if name is None or info.ggml_type != GGMLQuantizationType.Q4_1 or len(info.shape) != 2:
            continue
        proj = name.rsplit(".", 1)[0].split(".", 3)[-1]
        head_dim = info.shape[0] // heads[proj] if cfg.arch == "llama" and proj in heads else 0
        blocks = Q4Blocks(data, info, head_dim)
        if lazy:
            lazy_out[name] = blocks
        else:
            out[name] = blocks.rows(0, info.shape[0])
    return lazy_out if lazy else out


class Q4Blocks:
    """One Q4_1 tensor of a GGUF file, read on demand: :meth:`rows` (a column-parallel slice,
    whole heads for Q/K) or :meth:`cols` (a row-parallel slice, whole blocks)."""

    def __init__(self, data: np.ndarray, info: GGUFTensorInfo, head_dim: int) -> None:
        rows, k = info.shape
        self.shape = (rows, k)
        # [rows, blocks, 20 bytes], a view of the memory-mapped file: nothing read yet
        self._raw = data[info.offset : info.offset + rows * (k // 32) * 20].reshape(rows, k // 32, 20)
        self._head_dim = head_dim  # rows per head when llama.cpp permuted them for RoPE, else 0

    def rows(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(qs, d, m)`` of rows ``[lo, hi)`` (Hugging Face order)."""
        if self._head_dim and (lo % self._head_dim or hi % self._head_dim):
            raise ValueError(f"rows [{lo}, {hi}) split a head of {self._head_dim} rows")
        return self._decode(
            np.array(self._raw[lo:hi]), 0 if not self._head_dim else (hi - lo) // self._head_dim
        )

    def cols(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(qs, d, m)`` of input columns ``[lo, hi)`` (multiples of 32) of every row."""
        heads = self.shape[0] // self._head_dim if self._head_dim else 0
        return self._decode(np.array(self._raw[:, lo // 32 : hi // 32]), heads)

    @staticmethod
    def _decode(raw: np.ndarray, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, blocks = raw.shape[:2]
        d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        qs = torch.from_numpy(raw[..., 4:].reshape(rows, blocks * 16).copy())
        if heads:
            return tuple(unpermute_rope_rows(t, heads).contiguous() for t in (qs, d, m))  # type: ignore[return-value]
        return qs, d, m


def load_gguf_q8_blocks(path: str, cfg: ModelConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The Q8_0 tensors of a GGUF file as raw blocks, by Hugging Face name (no dequantization).

    A Q8_0 block of 32 weights is ``d: f16, qs: 32 x int8``. Returns ``name -> (qs int8 [N, K],
    d float32 [N, K/32])`` with Q/K rows in Hugging Face order, as :func:`load_gguf_weights` gives.
    """
    from gguf import GGMLQuantizationType

    g = read_gguf(path)
    data = np.memmap(g.path, dtype=np.uint8, mode="r")
    heads = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads}
    out = {}
    for info in g.tensors:
        name = hf_name(info.name)
        if name is None or info.ggml_type != GGMLQuantizationType.Q8_0 or len(info.shape) != 2:
            continue
        rows, k = info.shape
        raw = np.array(data[info.offset : info.offset + rows * (k // 32) * 34]).reshape(rows, k // 32, 34)
        d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        qs = torch.from_numpy(raw[..., 2:].reshape(rows, k).copy().view(np.int8))
        proj = name.rsplit(".", 1)[0].split(".", 3)[-1]
        if cfg.arch == "llama" and proj in heads:
            qs, d = (unpermute_rope_rows(t, heads[proj]).contiguous() for t in (qs, d))
        out[name] = (qs, d)
    return out


def gguf_block_types(path: str) -> set[str]:
    """Names of the quantized types (``Q4_1``, ``Q8_0``, ...) of a GGUF's 2-D model tensors."""
    from gguf import GGMLQuantizationType

    plain = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    return {
        GGMLQuantizationType(t.ggml_type).name
        for t in read_gguf(path).tensors
        if hf_name(t.name) is not None and len(t.shape) == 2 and t.ggml_type not in plain
    }


def _dequantize(data: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(info.ggml_type)
    block, type_size = GGML_QUANT_SIZES[qtype]
    row = info.shape[-1]
    row_bytes = row // block * type_size
    rows = int(np.prod(info.shape[:-1], dtype=np.int64))
    raw = data[info.offset : info.offset + rows * row_bytes].reshape(rows, row_bytes)
    return dequantize(raw, qtype).reshape(info.shape)


def _write_cache(folder: str, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Write atomically (temp name, then rename) so a crash never leaves a half cache."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{_WEIGHTS_FILE}.{os.getpid()}.tmp")
    save_file(tensors, tmp)
    os.replace(tmp, os.path.join(folder, _WEIGHTS_FILE))
    tmp = os.path.join(folder, f".{_CONFIG_FILE}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(dataclasses.asdict(cfg), f)
    os.replace(tmp, os.path.join(folder, _CONFIG_FILE))
