"""The few-row norm + projection kernels (``runtime/layers/row_fused.py``) and the decoder layer
that routes small-batch decode and verify passes through them.

- CUDA: the SmolLM2-135M and Llama-3-8B projection shapes in every variant (first layer, residual,
  bias, gate/up with SiLU x mul), 1-16 rows, both 16-bit dtypes; a tiny model's decode of one
  and of several rows with the folding on vs off.
- CPU: the small cases under Triton's interpreter (a child process, ``row_fused_cases.py``) and the
  routing rule.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from phloem.runtime.executor.model_runner import DirectBatcher
from phloem.runtime.layers.fusion import set_row_fusion, set_skinny_gemm, skinny_gemm_enabled, use_row_fusion

from .fused_cases import REL_TOL, rel_err
from .interpreter import assert_interpreted_cases_pass
from .row_fused_cases import (
    DTYPES,
    ROWS,
    SHAPES,
    SMALL_ROWS,
    SMALL_SHAPES,
    VARIANTS,
    check_norm_linear,
    check_rejects,
)
from .test_fused_triton import layered_forward, make_runner

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def restore_switches():
    skinny = skinny_gemm_enabled()
    yield
    set_skinny_gemm(skinny)
    set_row_fusion(True)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("variant", VARIANTS, ids=["first", "residual", "bias", "glu"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_norm_linear_matches_ref(
    shape: tuple[int, int], variant: tuple[bool, bool, bool], dtype: str, rows: int
) -> None:
    for seed in (0, 1):
        check_norm_linear(shape, DTYPES[dtype], "cuda", seed, variant, rows)


@pytest.mark.gpu
@requires_cuda
def test_norm_linear_rejects_bad_calls_cuda() -> None:
    check_rejects("cuda")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the compiled kernel is tested instead")
def test_norm_linear_under_interpreter() -> None:
    assert_interpreted_cases_pass(
        "tests.kernels.row_fused_cases",
        len(SMALL_SHAPES) * len(VARIANTS) * len(SMALL_ROWS) * len(DTYPES) + 1,
        shards=2,
    )


def test_routing_rule(restore_switches) -> None:
    from phloem.runtime.layers.linear import Linear
    from phloem.runtime.layers.row_fused import rows_fusion_max_rows

    layer = Linear(32, 8).to(torch.bfloat16)
    set_row_fusion(True)
    assert not use_row_fusion(torch.zeros(1, 32, dtype=torch.bfloat16), layer), "CPU stays unfused"
    if torch.cuda.is_available() and skinny_gemm_enabled():
        layer = layer.cuda()
        one = torch.zeros(1, 32, dtype=torch.bfloat16, device="cuda")
        assert use_row_fusion(one, layer)
        assert use_row_fusion(torch.zeros(5, 32, dtype=torch.bfloat16, device="cuda"), layer)
        many = torch.zeros(rows_fusion_max_rows() + 1, 32, dtype=torch.bfloat16, device="cuda")
        assert not use_row_fusion(many, layer)
        layer.row_tile = 16  # deterministic mode keeps its own matmul
        assert not use_row_fusion(one, layer)
        layer.row_tile = 0
        set_row_fusion(False)
        assert not use_row_fusion(one, layer)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_rows_fusion_rule() -> None:
    from phloem.runtime.layers.fusion import ROW_FUSION_MAX_ROWS
    from phloem.runtime.layers.row_fused import (
        MAX_ROWS,
        ROWS_FUSION_MAX_ELEMENTS,
        rows_fusion_max_k,
        rows_fusion_max_rows,
        rows_fusion_wins,
    )

    assert ROW_FUSION_MAX_ROWS == MAX_ROWS
    max_rows, max_k = rows_fusion_max_rows(), rows_fusion_max_k()
    assert rows_fusion_wins(128256, 4096, 1), "one row always folds"
    assert rows_fusion_wins(960, 576, 2) and rows_fusion_wins(960, 576, max_rows)
    assert not rows_fusion_wins(960, 576, max_rows + 1)
    assert not rows_fusion_wins(6144, 4096, 4), "a large weight keeps the library GEMM at 2-16 rows"
    assert not rows_fusion_wins(4096, 1024, 8), "Qwen3-0.6B's qkv: slower in the model"
    assert rows_fusion_wins(ROWS_FUSION_MAX_ELEMENTS // 64, 64, 8)
    assert not rows_fusion_wins(ROWS_FUSION_MAX_ELEMENTS // 64 + 1, 64, 8)
    assert not rows_fusion_wins(256, max_k + 1, 8), "rows longer than one chunk"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3"])
def test_decode_with_folding_matches_without(shape: str, batch: int, restore_switches) -> None:
    """Prompts, then one decode step of ``batch`` rows: hidden states and logits agree with the
    separate norm, matmul and SiLU kernels (the skinny kernel on in both)."""
    runner = make_runner(shape, "bfloat16", "cuda")
    batcher = DirectBatcher(runner)
    seqs = [batcher.new_sequence() for _ in range(batch)]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, runner.vocab_size, (7 + i,), generator=gen).tolist() for i in range(batch)]
    set_skinny_gemm(True)
    with torch.inference_mode():
        runner.forward(batcher.build(dict(zip(seqs, prompts, strict=True))))
        fi = batcher.build({s: [p[-1]] for s, p in zip(seqs, prompts, strict=True)}, decode=True).to("cuda")
        assert fi.num_tokens == batch
        set_row_fusion(False)
        h_off = layered_forward(runner, fi).clone()
        set_row_fusion(True)
        h_on = layered_forward(runner, fi)
        assert rel_err(h_on, h_off) <= 4 * REL_TOL[torch.bfloat16]
        err = rel_err(runner.model.compute_logits(h_on), runner.model.compute_logits(h_off))
        assert err <= 4 * REL_TOL[torch.bfloat16], f"logits rel err {err:.2e}"
