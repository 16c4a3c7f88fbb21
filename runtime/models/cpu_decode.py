"""A decode step of a llama-family model in one C++ call on the CPU (``layers/decode_step.h``).

Layer by layer, a decode step costs about forty Python calls and torch ops per layer; on the
default 135M model that is a third of the step. With the CPU defaults (GGUF integer-dot weights,
``--quantization gguf``, and the ``cpu`` attention backend) a decode batch runs every layer and
the final norm in one call instead. The call runs the same kernels in the same order as the
module path, so both give the same bits (``tests/unit/test_cpu_decode_step.py``).

Covered: every projection a packed Q4_1/Q8_0 weight, no q/k/v biases, no q/k norms, one rank,
float32 rows, autograd off, a decode batch whose layers all take the one-call attention. Anything
else, and ``PHLOEM_DISABLE_CPU_DECODE_STEP=1``, keeps the module path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from phloem.runtime import switches

if TYPE_CHECKING:
    from phloem.runtime.attention.base import AttentionBackend
    from phloem.runtime.models.llama import LlamaModel

__all__ = ["run_decode_step"]


def run_decode_step(
    model: LlamaModel, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend
) -> torch.Tensor | None:
    """The final hidden states ``[B, H]`` of a decode batch with embeddings ``x``, computed in one
    call; ``None`` where the step is not covered (the caller runs the layers itself)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or torch.is_grad_enabled():
        return None
    decode_tables = getattr(attn, "decode_tables", None)
    tables = decode_tables() if decode_tables is not None else None
    if tables is None:
        return None
    step = _step_for(model, attn)
    if step is None:
        return None
    cos, sin = rope
    out_slots, req_to_token, req, seq_lens = tables
    return step.run(x, out_slots, req_to_token, req, seq_lens, cos, sin)


def _step_for(model: LlamaModel, attn: AttentionBackend) -> Any:
    """The model's compiled step for ``attn``'s KV pool, built at first use; ``None`` if the model
    is not covered. Rebuilt when the pool's buffers change; :meth:`forget` drops it."""
    pool = attn.kv_pool
    key = (id(pool), pool.k_buffer[0].data_ptr() if pool.k_buffer else 0)
    cached = model.__dict__.get("_cpu_decode_step")
    if cached is not None and cached[0] == key:
        return cached[1]
    step = _build(model, attn)
    model.__dict__["_cpu_decode_step"] = (key, step)
    return step


def forget(model: LlamaModel) -> None:
    """Drop the compiled step (after weights change); the next decode builds it again."""
    model.__dict__.pop("_cpu_decode_step", None)


def _build(model: LlamaModel, attn: AttentionBackend) -> Any:
    from phloem.runtime.distributed.state import get_tp
    from phloem.runtime.layers.qdot import Q4DotWeight, Q8DotWeight, _load_kernels

    if switches.DISABLE_CPU_DECODE_STEP.flag() or get_tp().size != 1:
        return None
    kernels = _load_kernels()
    if kernels is None or not hasattr(kernels, "DecodeStep") or attn.kv_pool.dtype != torch.float32:
        return None
    layers = list(model.layers)
    if not layers:
        return None
    first = layers[0].self_attn
    heads, kv_heads, d = first.num_heads, first.num_kv_heads, first.head_dim
    eps = layers[0].input_layernorm.eps
    if d % 8:
        return None
    step = kernels.DecodeStep(heads, kv_heads, d, float(eps), float(attn.scale), model.norm.weight.detach())
    for i, layer in enumerate(layers):
        sa, mlp = layer.self_attn, layer.mlp
        projections = [sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj]
        if sa.q_norm is not None or any(p.bias is not None for p in projections):
            return None
        if (sa.num_heads, sa.num_kv_heads, sa.head_dim) != (heads, kv_heads, d) or sa.layer_id != i:
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm, model.norm)
        if any(n.eps != eps or n.weight.dtype != torch.float32 for n in norms):
            return None
        quants = [p.quant for p in projections]
        if not all(isinstance(q, (Q4DotWeight, Q8DotWeight)) for q in quants):
            return None
        k_buf, v_buf = attn.kv_pool.get_kv(i)
        step.add_layer(
            layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
            [q.packed for q in quants], [q.n for q in quants], [isinstance(q, Q4DotWeight) for q in quants],
            k_buf, v_buf,
        )  # fmt: skip
    return step
