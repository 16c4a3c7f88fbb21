"""``ModelConfig``: the architecture numbers a model needs, from GGUF metadata, an HF config.json,
or a named dummy shape (for benchmarks with random weights)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["DUMMY_SHAPES", "ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape (Llama family, Qwen2, Qwen3).

    ``rope_scaling`` is ``None`` or a Llama-3 style dict with keys ``factor``, ``low_freq_factor``,
    ``high_freq_factor`` and ``original_max_position_embeddings``.
    """

    arch: str  # registry key: "llama", "qwen2", "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    context_len: int = 4096
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def max_position_embeddings(self) -> int:
        return self.context_len

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_gguf_metadata(cls, md: dict[str, Any]) -> ModelConfig:
        """Build from GGUF metadata (llama.cpp key names, prefixed by ``general.architecture``).

        Parameters
        ----------
        md:
            Metadata dict; the tensor list decides ``tie_word_embeddings`` and ``attention_bias``
            when the caller adds ``"phloem.tensor_names"`` (a set of tensor names).
        """
        arch = md["general.architecture"]
        if arch not in ("llama", "qwen2", "qwen3"):
            raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen2, qwen3)")

        def get(key: str, default: Any = None) -> Any:
            return md.get(f"{arch}.{key}", default)

        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        names = md.get("phloem.tensor_names", set())
        vocab = get("vocab_size") or len(md.get("tokenizer.ggml.tokens", ())) or None
        if vocab is None:
            raise ValueError("the GGUF file states no vocabulary size and has no token list")
        return cls(
            arch=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(get),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings=bool(names) and "output.weight" not in names,
            context_len=int(get("context_length", 4096)),
            attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
            qk_norm=arch == "qwen3",
        )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (LlamaForCausalLM, Qwen2/Qwen3ForCausalLM)."""
        arch = _hf_arch(cfg)
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        theta, scaling = _hf_rope(cfg)
        return cls(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            context_len=int(cfg.get("max_position_embeddings", 4096)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
        )

    @classmethod
    def dummy(cls, shape: str) -> ModelConfig:
        """A named shape for ``--load-format dummy``: one of :data:`DUMMY_SHAPES`."""
        if shape not in DUMMY_SHAPES:
            raise ValueError(f"unknown dummy shape {shape!r}; known: {sorted(DUMMY_SHAPES)}")
        return DUMMY_SHAPES[shape]


def _gguf_rope_scaling(get: Any) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "llama3":
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported")
    return {
        "rope_type": "llama3",
        "factor": float(get("rope.scaling.factor", 8.0)),
        "low_freq_factor": float(get("rope.scaling.low_freq_factor", 1.0)),
        "high_freq_factor": float(get("rope.scaling.high_freq_factor", 4.0)),
        "original_max_position_embeddings": int(get("rope.scaling.original_context_length", 8192)),
    }


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE theta and Llama-3 scaling from ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` + ``rope_scaling`` keys."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"rope scaling {params} is not supported (only Llama-3 style)")
    return theta, params


_HF_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def _hf_arch(cfg: dict[str, Any]) -> str:
    for name in cfg.get("architectures") or ():
        if name in _HF_ARCHS:
            return _HF_ARCHS[name]
    model_type = cfg.get("model_type")
    if model_type in ("llama", "qwen2", "qwen3"):
        return model_type
    raise ValueError(f"unsupported architecture {cfg.get('architectures')} / model_type {model_type!r}")


# Llama-3.1's RoPE scaling (both dummy Llama-3 shapes use it)
_LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

DUMMY_SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        arch="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        context_len=8192,
    ),
    "qwen3-0.6b": ModelConfig(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        context_len=40960,
        qk_norm=True,
    ),
    "llama3-8b": ModelConfig(
        arch="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        rope_scaling=_LLAMA3_ROPE_SCALING,
        context_len=131072,
    ),
    # Too large for one GPU in bf16 (141 GB of weights): the tensor-parallel shape.
    "llama3-70b": ModelConfig(
        arch="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        rope_scaling=_LLAMA3_ROPE_SCALING,
        context_len=131072,
    ),
    # Tiny shape for fast unit tests.
    "tiny-llama": ModelConfig(
        arch="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        context_len=1024,
    ),
    "tiny-qwen3": ModelConfig(
        arch="qwen3",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        context_len=1024,
        qk_norm=True,
    ),
}
