"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2 with q/k/v bias, Qwen3 with q/k RMSNorm).

Parameter names follow Hugging Face checkpoints except for two fused projections:
``self_attn.qkv_proj`` (q, k, v stacked) and ``mlp.gate_up_proj`` (gate, up stacked), filled by
:meth:`LlamaForCausalLM.load_weights` from the separate checkpoint tensors.

Tensor parallelism (built inside a process where ``distributed.state.init_tp`` ran): each rank
holds its attention heads (``models/sharding.py``: query heads split evenly, KV heads split or,
with more ranks than KV heads, replicated) as the q/k/v rows of ``qkv_proj`` and the matching input
columns of ``o_proj`` (row parallel, all-reduced); an equal share of the MLP's intermediate
features as the gate/up rows and the ``down_proj`` columns; a range of the vocabulary in the
embedding and LM head. Norms, Qwen3's per-head q/k norms and RoPE are replicated. Qwen2's q/k/v
biases split with their part. :meth:`LlamaForCausalLM.load_weights` takes full checkpoint tensors
(or lazy slices) and keeps this rank's share.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from phloem.runtime.attention.base import AttentionBackend, QKNorm
from phloem.runtime.distributed.slices import TensorLike, materialize, shape_of
from phloem.runtime.distributed.state import get_tp
from phloem.runtime.layers.activation import silu_and_mul
from phloem.runtime.layers.embedding import LMHead, VocabEmbedding
from phloem.runtime.layers.fusion import use_row_fusion
from phloem.runtime.layers.linear import MergedLinear, RowParallelLinear
from phloem.runtime.layers.rmsnorm import RMSNorm
from phloem.runtime.layers.rotary import RotaryEmbedding
from phloem.runtime.models import cpu_decode
from phloem.runtime.models.config import ModelConfig
from phloem.runtime.models.sharding import per_rank_heads
from torch import nn

__all__ = ["LlamaForCausalLM"]

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin tables of this batch's positions, [T, 1, D/2]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        heads, d = per_rank_heads(cfg, get_tp()), cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, d
        q_size, kv_size = heads.num_heads * d, heads.num_kv_heads * d  # this rank's
        self.split = [q_size, kv_size, kv_size]
        q_rows = (heads.q_start * d, heads.q_start * d + q_size)
        kv_rows = (heads.kv_start * d, heads.kv_start * d + kv_size)
        full_q, full_kv = cfg.num_heads * d, cfg.num_kv_heads * d
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, {"q": full_q, "k": full_kv, "v": full_kv}, bias=cfg.attention_bias,
            rows={"q": q_rows, "k": kv_rows, "v": kv_rows},
        )  # fmt: skip
        self.o_proj = RowParallelLinear(full_q, cfg.hidden_size, cols=q_rows)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, rope: Rope, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        return self.attend(rope, self.qkv_proj(x), attn)

    def attend(self, rope: Rope, qkv: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Attention and the output projection, from the stacked q/k/v projection ``[T, q+k+v]``."""
        t = qkv.shape[0]
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        qk_norm = None
        if self.q_norm is not None and self.k_norm is not None:  # applied with RoPE by the backend
            qk_norm = QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        out = attn.forward(q, k, v, self.layer_id, cos_sin=rope, qk_norm=qk_norm)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, -1))  # [T, Hq * D] -> [T, H]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        width = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": width, "up": width})
        self.down_proj = RowParallelLinear(width, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None, attn: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block on the running sum ``h = x + residual`` (``residual`` is ``None`` for the
        first layer, where ``h = x``)::

            h = h + attn(norm(h))
            h = h + mlp(norm(h))

        The last add is left to the next norm (which fuses it on CUDA): returns the MLP output
        and the residual, whose sum is the block's output. A few rows on CUDA (small-batch decode,
        verify; ``fusion.use_row_fusion``): each norm runs inside the projection after it, SiLU x
        mul inside gate/up (``row_fused``).
        """
        if use_row_fusion(x, self.self_attn.qkv_proj):
            return self._forward_row(rope, x, residual, attn)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _forward_row(
        self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None, attn: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` in four launches plus attention: norm + qkv, attention, o, norm +
        gate/up + SiLU x mul, down."""
        from phloem.runtime.layers.row_fused import norm_linear_rows

        qkv_proj, gate_up = self.self_attn.qkv_proj, self.mlp.gate_up_proj
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        qkv, residual = norm_linear_rows(x, residual, n1.weight, n1.eps, qkv_proj.weight, qkv_proj.bias)
        x = self.self_attn.attend(rope, qkv, attn)
        if not use_row_fusion(x, gate_up):
            x, residual = n2(x, residual)
            return self.mlp(x), residual
        act, residual = norm_linear_rows(x, residual, n2.weight, n2.eps, gate_up.weight, glu=True)
        return self.mlp.down_proj(act), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.context_len, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary.cos_sin(positions)  # shared by every layer
        if x.device.type == "cpu":  # a decode batch in one C++ call where covered
            hidden = cpu_decode.run_decode_step(self, x, rope, attn)
            if hidden is not None:
                return hidden
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, attn)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]


# checkpoint name -> (fused parameter prefix, part) for the stacked projections
_FUSED = re.compile(r"^(.*)\.(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")


class LlamaForCausalLM(nn.Module):
    """Causal LM: ``forward`` gives final hidden states, ``compute_logits`` the float32 logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=tied)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Hidden states ``[T, H]`` after the final norm; writes every layer's K/V through ``attn``."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` -> float32 logits ``[N, V]``."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, TensorLike]]) -> None:
        """Copy checkpoint tensors (Hugging Face names, full tensors or lazy slices) into the
        parameters; under tensor parallelism, only this rank's share of each.

        Raises
        ------
        ValueError
            On an unknown name, a shape mismatch, or a parameter left unloaded.
        """
        cpu_decode.forget(self.model)
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            loaded.add(self._load_one(params, name, tensor))
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")

    def _load_one(self, params: dict[str, nn.Parameter], name: str, tensor: TensorLike) -> str:
        fused = _FUSED.match(name)
        if fused:
            prefix, kind, part, which = (
                fused.group(1),
                fused.group(2),
                fused.group(3) or fused.group(4),
                fused.group(5),
            )
            target = "self_attn.qkv_proj" if kind.startswith("self_attn") else "mlp.gate_up_proj"
            module = self.get_submodule(f"{prefix}.{target}")
            assert isinstance(module, MergedLinear)
            module.load_part(part, tensor, is_bias=which == "bias")
            return f"{prefix}.{target}.{which}"
        if name not in params:
            raise ValueError(f"unexpected checkpoint tensor {name!r}")
        owner_name, leaf = name.rsplit(".", 1)
        owner: Any = self.get_submodule(owner_name)
        sharded = hasattr(owner, "shard_of")  # a tensor-parallel layer (whole with one rank)
        expected = owner.full_shape(leaf) if sharded else tuple(params[name].shape)
        if expected != shape_of(tensor):
            raise ValueError(f"{name}: expected shape {expected}, got {shape_of(tensor)}")
        with torch.no_grad():
            params[name].copy_(owner.shard_of(leaf, tensor) if sharded else materialize(tensor))
        return name

    def checkpoint_target(self, name: str) -> torch.Tensor:
        """The tensor a checkpoint tensor ``name`` (Hugging Face name) is copied into: a parameter,
        or the rows of a fused projection that hold one of its parts. Updating weights in place
        writes there, so the model (and any CUDA graph captured over it) keeps its tensors.

        Raises
        ------
        KeyError
            When ``name`` is no tensor of this model, or its float weight is gone (a quantized
            layer, or an embedding whose tied LM head keeps a quantized copy), or the model is
            split across tensor-parallel ranks (each holds a slice); the message says which.
        """
        tp = get_tp()
        if tp.size > 1:
            raise KeyError(f"{name}: in-place weight updates are not supported with --tp-size {tp.size}")
        fused = _FUSED.match(name)
        if fused:
            prefix, kind, which = fused.group(1), fused.group(2), fused.group(5)
            part = fused.group(3) or fused.group(4)
            target = "self_attn.qkv_proj" if kind.startswith("self_attn") else "mlp.gate_up_proj"
            try:
                module = self.get_submodule(f"{prefix}.{target}")
            except AttributeError:
                raise KeyError(f"{name}: no such tensor in this model") from None
            assert isinstance(module, MergedLinear)
            if module.quant is not None:
                raise KeyError(f"{name}: this layer is quantized")
            holder = module.bias if which == "bias" else module.weight
            if holder is None:
                raise KeyError(f"{name}: no such tensor in this model")
            lo, hi = module.offsets[part]
            return holder[lo:hi]
        if name == "lm_head.weight" and self.lm_head.tied_to is not None:
            raise KeyError(f"{name}: the LM head shares model.embed_tokens.weight on this model; update that")
        params = dict(self.named_parameters())
        if name not in params:
            owner = dict(self.named_modules()).get(name.rsplit(".", 1)[0])
            if getattr(owner, "quant", None) is not None:
                raise KeyError(f"{name}: this layer is quantized")
            raise KeyError(f"{name}: no such tensor in this model")
        head = self.lm_head
        if name == "model.embed_tokens.weight" and head.tied_to is not None and head.quant is not None:
            raise KeyError(f"{name}: the quantized LM head keeps its own copy of this tied embedding")
        return params[name]
