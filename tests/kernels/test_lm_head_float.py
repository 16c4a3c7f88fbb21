"""Float32 logits from the LM head (``runtime/layers/embedding.py``: ``float_out_linear``).

- CUDA: batches past the skinny kernel's rows take ``torch.mm(..., out_dtype=float32)``; the
  result is the float32 accumulator, so it sits within float32 rounding of a float64 oracle and
  strictly closer to it than the widened 16-bit product the head used to return.
- CPU (and any tensor the fast path does not take): the widened 16-bit product, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from phloem.runtime.layers.embedding import LMHead, VocabEmbedding, float_out_linear

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _operands(rows: int, vocab: int, hidden: int, dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen, device=device) * 0.05).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_is_the_widened_product(dtype):
    x, w = _operands(5, 300, 64, dtype, "cpu", 0)
    y = float_out_linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (5, 300)
    assert torch.equal(y, F.linear(x, w).float())


def test_cpu_head_tied_and_untied_match_the_helper():
    x, w = _operands(3, 120, 32, torch.bfloat16, "cpu", 1)
    emb = VocabEmbedding(120, 32).to(torch.bfloat16)
    emb.weight.data.copy_(w)
    tied = LMHead(120, 32, tied_to=emb)
    untied = LMHead(120, 32).to(torch.bfloat16)
    untied.weight.data.copy_(w)
    for head in (tied, untied):
        assert torch.equal(head(x), float_out_linear(x, w))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [17, 64, 208])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_float_accumulator(rows, dtype, seed):
    x, w = _operands(rows, 49152, 576, dtype, "cuda", seed)
    y = float_out_linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (rows, 49152)
    exact = F.linear(x.double(), w.double())
    err = (y.double() - exact).abs().max().item()
    widened = (F.linear(x, w).float().double() - exact).abs().max().item()
    scale = exact.abs().max().item()
    assert err <= 1e-5 * scale, (err, scale)  # float32 accumulation, no 16-bit rounding
    assert err < widened  # the 16-bit product loses more


@requires_cuda
@pytest.mark.gpu
def test_cuda_head_takes_the_float_path_and_argmax_agrees():
    x, w = _operands(96, 49152, 576, torch.bfloat16, "cuda", 3)
    head = LMHead(49152, 576).to(device="cuda", dtype=torch.bfloat16)
    head.weight.data.copy_(w)
    y = head(x)
    assert torch.equal(y, float_out_linear(x, w))
    exact = F.linear(x.double(), w.double())
    # where the top two logits differ by more than float32 noise, the choice is the exact one
    top2 = exact.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4 * exact.abs().max()
    assert torch.equal(y.argmax(-1)[clear], exact.argmax(-1)[clear])
