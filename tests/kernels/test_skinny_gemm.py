"""The skinny matmul kernel against ``F.linear``, and the layers that route to it.

- CUDA: every decode-sized shape of SmolLM2-135M and Llama-3-8B at 1, 2, 5 and 16 rows, both
  16-bit dtypes, fresh inputs per seed; a tiny model's logits with the kernel on vs off.
- CPU: the small cases under Triton's interpreter (a child process, ``skinny_cases.py``), and the
  routing rules (CPU, float32 and batches over 16 rows stay on ``F.linear``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from phloem.runtime.layers.fusion import SKINNY_MAX_ROWS, set_skinny_gemm, skinny_gemm_enabled, use_skinny

from .fused_cases import REL_TOL, rel_err
from .interpreter import assert_interpreted_cases_pass
from .skinny_cases import DTYPES, ROWS, SHAPES, SMALL_SHAPES, check_rejects, check_skinny
from .test_fused_triton import batches, layered_forward, make_runner

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def restore_skinny():
    before = skinny_gemm_enabled()
    yield
    set_skinny_gemm(before)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_skinny_matches_linear(shape: tuple[int, int], rows: int, dtype: str) -> None:
    for seed in (0, 1):
        check_skinny(shape, rows, DTYPES[dtype], "cuda", seed)


@pytest.mark.gpu
@requires_cuda
def test_skinny_rejects_bad_calls_cuda() -> None:
    check_rejects("cuda")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the compiled kernel is tested instead")
def test_skinny_under_interpreter() -> None:
    assert_interpreted_cases_pass(
        "tests.kernels.skinny_cases", len(SMALL_SHAPES) * len(ROWS) * len(DTYPES) + 1
    )


def test_routing_rules(restore_skinny) -> None:
    set_skinny_gemm(True)
    w16 = torch.zeros(8, 32, dtype=torch.bfloat16)
    assert not use_skinny(torch.zeros(1, 32, dtype=torch.bfloat16), w16), "CPU tensors stay on F.linear"
    if torch.cuda.is_available() and skinny_gemm_enabled():
        w = w16.cuda()
        assert use_skinny(torch.zeros(SKINNY_MAX_ROWS, 32, dtype=torch.bfloat16, device="cuda"), w)
        assert not use_skinny(torch.zeros(SKINNY_MAX_ROWS + 1, 32, dtype=torch.bfloat16, device="cuda"), w)
        assert not use_skinny(torch.zeros(1, 32, device="cuda"), w.float()), "float32 stays on F.linear"
        set_skinny_gemm(False)
        assert not use_skinny(torch.zeros(1, 32, dtype=torch.bfloat16, device="cuda"), w)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_linear_layer_routes_to_skinny(dtype: str, restore_skinny) -> None:
    from phloem.runtime.layers.linear import Linear

    torch.manual_seed(0)
    layer = Linear(576, 960, bias=True).to("cuda", getattr(torch, dtype))
    with torch.no_grad():
        layer.weight.normal_(0, 576**-0.5)
        layer.bias.normal_()
    x = torch.randn(3, 576, device="cuda").to(layer.weight.dtype)
    set_skinny_gemm(False)
    plain = layer(x)
    assert torch.equal(plain, F.linear(x, layer.weight, layer.bias))
    set_skinny_gemm(True)
    skinny = layer(x)
    assert rel_err(skinny, plain) <= 2 * REL_TOL[layer.weight.dtype]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3"])
def test_model_with_skinny_matches_without(shape: str, restore_skinny) -> None:
    """A decode step (two rows) and a prefill of 13 tokens: hidden states and logits agree."""
    runner = make_runner(shape, "bfloat16", "cuda")
    with torch.inference_mode():
        for fi in batches(runner):
            fi = fi.to("cuda")
            set_skinny_gemm(False)
            h_off = layered_forward(runner, fi).clone()
            logits_off = runner.model.compute_logits(h_off)
            set_skinny_gemm(True)
            h_on = layered_forward(runner, fi)
            logits_on = runner.model.compute_logits(h_on)
            assert rel_err(h_on, h_off) <= 4 * REL_TOL[torch.bfloat16]
            assert logits_on.dtype == torch.float32
            assert rel_err(logits_on, logits_off) <= 4 * REL_TOL[torch.bfloat16]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_config_and_routing_table() -> None:
    """Block sizes are powers of two, the dot path gets 16+ columns, and the routing keeps the
    shapes where the GEMM library measured faster (wide weights at several rows) on the library."""
    from phloem.runtime.layers.skinny_gemm import MAX_ROWS, pick_config, skinny_wins

    assert SKINNY_MAX_ROWS == MAX_ROWS, "fusion.py routes by a copy of the kernel's row limit"
    for n, k in SHAPES:
        for rows in ROWS:
            cfg = pick_config(n, k, rows)
            for v in (cfg.block_n, cfg.block_k, cfg.num_warps):
                assert v & (v - 1) == 0, cfg
            assert rows == 1 or cfg.block_n >= 16, cfg
    assert all(skinny_wins(n, k, 1) for n, k in SHAPES)
    assert skinny_wins(576, 1536, 8) and skinny_wins(4096, 14336, 8)  # MLP down
    assert not skinny_wins(960, 576, 8)  # a small model's qkv
    assert not skinny_wins(3072, 576, 8) and not skinny_wins(28672, 4096, 4)  # wide MLP up
    assert not skinny_wins(49152, 576, 2)  # the LM head at several rows
