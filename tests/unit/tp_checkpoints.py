"""Small model configs and seeded full checkpoints for the tensor-parallel tests."""

from __future__ import annotations

import json
import os

import torch
from phloem.runtime.models.config import ModelConfig

# 8 query heads over 2 KV heads: at --tp-size 4 each KV head is held by two ranks. The vocabulary
# (250) is no multiple of 4, so the LM head pads and trims.
KV_REPLICATED = ModelConfig(
    arch="llama", vocab_size=250, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
    num_kv_heads=2, head_dim=16, tie_word_embeddings=True, context_len=512,
)  # fmt: skip
# Qwen2-style q/k/v biases, an untied LM head and an odd vocabulary.
QWEN2_BIAS = ModelConfig(
    arch="qwen2", vocab_size=301, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, attention_bias=True, context_len=512,
)  # fmt: skip
# Qwen3-style RMSNorm over each q/k head (replicated on every rank).
QWEN3_QK_NORM = ModelConfig(
    arch="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=32, qk_norm=True, tie_word_embeddings=True, context_len=512,
)  # fmt: skip

_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def full_checkpoint(cfg: ModelConfig, *, seed: int = 0, std: float = 0.2) -> dict[str, torch.Tensor]:
    """Every tensor of ``cfg``'s Hugging Face checkpoint, drawn from ``seed`` (norms near 1, biases
    nonzero, so slicing either shows)."""
    gen = torch.Generator().manual_seed(seed)
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    def norm(n: int) -> torch.Tensor:
        return 1 + rand(n)

    out = {"model.embed_tokens.weight": rand(cfg.vocab_size, h), "model.norm.weight": norm(h)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = rand(cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        out |= {
            f"{p}.input_layernorm.weight": norm(h),
            f"{p}.post_attention_layernorm.weight": norm(h),
            f"{p}.self_attn.q_proj.weight": rand(q, h),
            f"{p}.self_attn.k_proj.weight": rand(kv, h),
            f"{p}.self_attn.v_proj.weight": rand(kv, h),
            f"{p}.self_attn.o_proj.weight": rand(h, q),
            f"{p}.mlp.gate_proj.weight": rand(inter, h),
            f"{p}.mlp.up_proj.weight": rand(inter, h),
            f"{p}.mlp.down_proj.weight": rand(h, inter),
        }
        if cfg.attention_bias:
            out |= {f"{p}.self_attn.{x}_proj.bias": rand(n) for x, n in (("q", q), ("k", kv), ("v", kv))}
        if cfg.qk_norm:
            out |= {f"{p}.self_attn.q_norm.weight": norm(d), f"{p}.self_attn.k_norm.weight": norm(d)}
    return out


def write_hf_folder(folder: str, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> str:
    """A Hugging Face model folder (config.json + model.safetensors) of ``cfg``."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    config = {
        "architectures": [_HF_ARCH[cfg.arch]],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.context_len,
        "attention_bias": cfg.attention_bias,
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    return folder
