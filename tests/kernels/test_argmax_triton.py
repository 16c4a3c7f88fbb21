"""The two-launch greedy argmax against ``torch.argmax``, and the sampler that routes to it.

- CUDA: SmolLM2 and Llama-3 vocabularies at batch 1, 64 and 256, float32 and bfloat16, with ties;
  a greedy batch through :class:`Sampler` equals ``torch.argmax`` of its logits.
- CPU: the small cases under Triton's interpreter (a child process, ``argmax_cases.py``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from phloem.runtime.executor.model_runner import greedy_sampling_info
from phloem.runtime.sampling.sampler import Sampler

from .argmax_cases import SHAPES, SMALL_SHAPES, check_argmax
from .interpreter import assert_interpreted_cases_pass

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_argmax_matches_torch(shape: tuple[int, int], dtype: str) -> None:
    for seed in (0, 1):
        check_argmax(shape, getattr(torch, dtype), "cuda", seed)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("vocab", [49152, 128256])
def test_greedy_sampler_routes_by_vocabulary_and_matches_torch(vocab: int, monkeypatch) -> None:
    from phloem.runtime.sampling import argmax_triton
    from phloem.runtime.sampling.sampler import TRITON_ARGMAX_MIN_VOCAB

    calls = []
    real = argmax_triton.argmax_rows
    monkeypatch.setattr(argmax_triton, "argmax_rows", lambda x: calls.append(x.shape) or real(x))
    logits = torch.randn(8, vocab, device="cuda") * 3
    info = greedy_sampling_info(8)
    dev_info = type(info)(
        **{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in vars(info).items()}
    )
    assert dev_info.is_greedy_all
    assert torch.equal(Sampler()(logits, dev_info), logits.argmax(dim=-1))
    assert len(calls) == (1 if vocab >= TRITON_ARGMAX_MIN_VOCAB else 0)
    # continuous decode's replayed steps take the Triton argmax for every vocabulary
    calls.clear()
    assert torch.equal(Sampler().step_sampler(dev_info)(logits), logits.argmax(dim=-1))
    assert len(calls) == 1


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the compiled kernels are tested instead")
def test_argmax_under_interpreter() -> None:
    assert_interpreted_cases_pass("tests.kernels.argmax_cases", 2 * len(SMALL_SHAPES))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_batch_sizes_share_a_few_compiled_variants() -> None:
    """Every compile-time constant of the launch is one of a few values over all batch sizes a
    server sees (a new one compiles mid-run, a ~0.2 s stall), and the chunks cover each row."""
    from phloem.runtime.sampling.argmax_triton import launch_plan

    for vocab in (49152, 151936, 128256, 1000):
        plans = [launch_plan(rows, vocab) for rows in range(1, 1025)]
        assert len({block for _, _, block in plans}) <= 7
        for chunk, s, block in plans:
            assert chunk % 1024 == 0 and (s - 1) * chunk < vocab <= s * chunk and s <= block


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_warm_up_rows_reach_every_launch_plan() -> None:
    """``plan_rows`` holds one batch size per compiled variant, and those variants are all that
    any batch size uses: warming them up leaves nothing to compile while serving."""
    from phloem.runtime.sampling.argmax_triton import launch_plan, plan_rows

    for vocab in (49152, 151936, 128256, 32000, 1000):
        firsts = plan_rows(vocab)
        warmed = {launch_plan(rows, vocab)[2] for rows in firsts}
        assert len(warmed) == len(firsts)
        assert {launch_plan(rows, vocab)[2] for rows in range(1, 4097)} == warmed


def test_no_kernel_warm_up_without_the_fused_kernels() -> None:
    from phloem.runtime.sampling.sampler import warm_up_kernels

    assert warm_up_kernels(1000, torch.device("cpu")) == 0


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("vocab", [49152, 128256])
def test_warm_up_leaves_nothing_to_compile_at_any_batch_size(vocab: int) -> None:
    """After the start-up warm-up, greedy steps at every batch size up to 300, plain and under a
    device automaton with several key counts, compile no kernel (a compile mid-run is a stall)."""
    from phloem.runtime.sampling import argmax_triton, automaton_triton
    from phloem.runtime.sampling.sampler import warm_up_kernels

    from .automaton_cases import random_table

    kernels = [argmax_triton._chunk_argmax_kernel, argmax_triton._pick_chunk_kernel,
               automaton_triton._masked_chunk_argmax_kernel, automaton_triton._pick_and_advance_kernel]  # fmt: skip
    dev = torch.cuda.current_device()

    def compiled() -> int:
        return sum(len(k.device_caches[dev][0]) for k in kernels)

    assert warm_up_kernels(vocab, torch.device("cuda")) > 0
    before = compiled()
    tables = [[t.cuda() for t in (s.masks, s.keys, s.targets)] for s in (random_table(vocab, n, n) for n in (3, 40))]
    padded = torch.randn(300, vocab, device="cuda")
    for rows in range(1, 301):
        x = padded[:rows]  # a decode graph's logits: the first rows of a padded batch
        assert torch.equal(argmax_triton.argmax_rows(x), x.argmax(dim=-1))
        state = torch.zeros(rows, dtype=torch.int32, device="cuda")
        automaton_triton.automaton_greedy(x, state, torch.arange(rows, device="cuda"), *tables[rows % 2])
    assert compiled() == before
