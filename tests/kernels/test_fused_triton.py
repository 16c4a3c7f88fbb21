"""Fused layer kernels (``runtime/layers/fused_triton.py``) against their torch references, and the
residual-carrying decoder layer against the plain ``x + attn(norm(x))`` forward.

- CUDA: every kernel over decode-like shapes and all three dtypes, fresh inputs per seed, and the
  whole model with the fused kernels on vs off.
- CPU: the small cases under Triton's interpreter (a child process, ``fused_cases.py``), and the
  decoder layer's new structure, which must give bit-identical hidden states.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.forward_io import ForwardInput
from phloem.runtime.layers.fusion import fused_kernels_enabled, set_fused_kernels, use_fused
from phloem.runtime.model_files import ModelSource

from .fused_cases import (
    DTYPES,
    NORM_SHAPES,
    REL_TOL,
    ROPE_SHAPES,
    SILU_SHAPES,
    SMALL_NORM_SHAPES,
    SMALL_ROPE_SHAPES,
    SMALL_SILU_SHAPES,
    check_rmsnorm,
    check_rope,
    check_rope_store,
    check_rope_store_fp8,
    check_silu_and_mul,
    rel_err,
)
from .interpreter import assert_interpreted_cases_pass

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---- kernels on CUDA ------------------------------------------------------------------------------
@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_rmsnorm_matches_ref(shape: tuple[int, int], dtype: str) -> None:
    for seed in (0, 1):
        check_rmsnorm(shape, DTYPES[dtype], "cuda", seed)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", SILU_SHAPES, ids=str)
def test_silu_and_mul_matches_ref(shape: tuple[int, int], dtype: str) -> None:
    for seed in (0, 1):
        check_silu_and_mul(shape, DTYPES[dtype], "cuda", seed)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
def test_rope_matches_ref(shape: tuple[int, int, int, int], dtype: str) -> None:
    for seed in (0, 1):
        check_rope(shape, DTYPES[dtype], "cuda", seed)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("k_inplace", [False, True], ids=["k_kept", "k_inplace"])
def test_rope_store_matches_ref(
    shape: tuple[int, int, int, int], dtype: str, qk_norm: bool, k_inplace: bool
) -> None:
    for seed in (0, 1):
        check_rope_store(shape, DTYPES[dtype], "cuda", seed, qk_norm=qk_norm, k_inplace=k_inplace)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 0.02)], ids=["scale1", "scaled"])
def test_rope_store_fp8_matches_set_kv(shape: tuple[int, int, int, int], dtype: str, scales) -> None:
    for seed in (0, 1):
        check_rope_store_fp8(shape, DTYPES[dtype], "cuda", seed, scales)


# ---- kernels under the interpreter (CPU) ----------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the compiled kernels are tested instead")
def test_fused_kernels_under_interpreter() -> None:
    cases = len(SMALL_NORM_SHAPES) + len(SMALL_SILU_SHAPES) + 4 * len(SMALL_ROPE_SHAPES)
    assert_interpreted_cases_pass("tests.kernels.fused_cases", cases * len(DTYPES))


# ---- the decoder layer ----------------------------------------------------------------------------
def plain_forward(runner: ModelRunner, fi: ForwardInput) -> torch.Tensor:
    """The decoder as written before it carried the residual: ``x = x + sublayer(norm(x))``."""
    model = runner.model.model
    attn = runner.attn_backend
    attn.init_metadata(fi)
    x = model.embed_tokens(fi.input_ids)
    rope = model.rotary.cos_sin(fi.positions)
    for layer in model.layers:
        x = x + layer.self_attn(rope, layer.input_layernorm(x), attn)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x)


def layered_forward(runner: ModelRunner, fi: ForwardInput) -> torch.Tensor:
    runner.attn_backend.init_metadata(fi)
    return runner.model(fi.input_ids, fi.positions, runner.attn_backend)


def make_runner(
    shape: str, dtype: str, device: str, backend: str = "torch_ref", kv_cache_dtype: str = "auto"
) -> ModelRunner:
    runner = ModelRunner(
        ModelSource("dummy", shape), dtype=dtype, device=device, attention_backend=backend,
        max_total_tokens=512, max_running_requests=4, cpu_threads=1, cuda_graph_max_bs=0,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # norms away from 1 and larger weights, so every term matters
        for name, p in runner.model.named_parameters():
            scale = 0.3 if name.endswith("norm.weight") else 0.08
            noise = torch.randn(p.shape, generator=gen) * scale
            p.copy_((1 + noise if name.endswith("norm.weight") else noise).to(p.dtype))
    return runner


def batches(runner: ModelRunner) -> list[ForwardInput]:
    """An extend batch of two prompts, then one decode step of both (same KV slots each time)."""
    batcher = DirectBatcher(runner)
    a, b = batcher.new_sequence(), batcher.new_sequence()
    gen = torch.Generator().manual_seed(5)
    vocab = runner.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    return [batcher.build({a: ids(9), b: ids(4)}), batcher.build({a: ids(1), b: ids(1)}, decode=True)]


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3"])
def test_decoder_carrying_residual_matches_plain_forward_cpu(shape: str, dtype: str, restore_threads) -> None:
    runner = make_runner(shape, dtype, "cpu")
    with torch.inference_mode():
        for fi in batches(runner):
            new, old = layered_forward(runner, fi), plain_forward(runner, fi)
            assert torch.equal(new, old), f"max diff {(new.float() - old.float()).abs().max()}"


# ---- the switch and the whole model on CUDA -------------------------------------------------------
@pytest.fixture
def restore_switch():
    before = fused_kernels_enabled()
    yield
    set_fused_kernels(before)


def test_switch_leaves_cpu_on_the_reference(restore_switch) -> None:
    set_fused_kernels(True)
    assert not use_fused(torch.zeros(2))
    set_fused_kernels(False)
    assert not fused_kernels_enabled()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("backend", ["torch_ref", "triton"])
def test_model_fused_matches_unfused_cuda(shape: str, dtype: str, backend: str, restore_switch) -> None:
    """With Triton attention the fused side also takes ``rope_store_`` (with Qwen3's q/k norms
    folded in); the unfused side normalizes, rotates and writes the pool separately."""
    runner = make_runner(shape, dtype, "cuda", backend)
    with torch.inference_mode():
        for fi in batches(runner):
            fi = fi.to("cuda")
            set_fused_kernels(False)
            plain = plain_forward(runner, fi).clone()
            unfused = layered_forward(runner, fi).clone()
            set_fused_kernels(True)
            fused = layered_forward(runner, fi)
            assert torch.equal(unfused, plain)
            err = rel_err(fused, unfused)
            assert err <= 4 * REL_TOL[runner.dtype], f"fused vs unfused model: rel err {err:.2e}"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3"])
def test_model_fp8_pool_fused_matches_unfused_cuda(shape: str, dtype: str, restore_switch) -> None:
    """An fp8 KV pool: the fused side quantizes inside ``rope_store_``, the unfused side rotates
    and then quantizes in ``KVPool.set_kv``. Both store the same rounding of the same values, so
    the outputs differ only where the rotations round differently before quantizing."""
    runner = make_runner(shape, dtype, "cuda", "triton", kv_cache_dtype="fp8_e4m3")
    assert runner.kv_pool.is_fp8
    with torch.inference_mode():
        for fi in batches(runner):
            fi = fi.to("cuda")
            set_fused_kernels(False)
            unfused = layered_forward(runner, fi).clone()
            set_fused_kernels(True)
            fused = layered_forward(runner, fi)
            err = rel_err(fused, unfused)
            assert err <= 0.02, f"fused vs unfused model over an fp8 pool: rel err {err:.2e}"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3"])
def test_model_contiguous_extend_matches_pool_extend_cuda(
    shape: str, dtype: str, restore_switch, monkeypatch
) -> None:
    """Fused kernels on, Triton attention: ``rope_store_`` leaves the rotated k in place and the
    extend passes read the new keys from it (``triton_extend_contig``), against the pool kernel."""
    from phloem.runtime.attention import triton_extend_contig

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need compute capability 9.0")
    runner = make_runner(shape, dtype, "cuda", "triton")
    set_fused_kernels(True)
    with torch.inference_mode():
        for fi in batches(runner):
            fi = fi.to("cuda")
            monkeypatch.setattr(triton_extend_contig, "MODE", "pool")
            pool = layered_forward(runner, fi).clone()
            monkeypatch.setattr(triton_extend_contig, "MODE", "contiguous")
            contig = layered_forward(runner, fi)
            err = rel_err(contig, pool)
            assert err <= 4 * REL_TOL[runner.dtype], f"contiguous vs pool extend: rel err {err:.2e}"
