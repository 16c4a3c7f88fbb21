"""Triton paged attention against the ``torch_ref`` oracle on fresh random batches (CUDA).

The same kernels run on the CPU under Triton's interpreter in ``test_attention_triton_interpret.py``.
The extend kernel's launch settings (``KNOB_CASES``) run both ways: compiled on CUDA, and on the CPU
through this module's script entry under the interpreter.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from phloem.runtime.executor.forward_io import ForwardMode

from .attention_cases import (
    BATCHES,
    DTYPES,
    HEADS,
    REL_TOL,
    Heads,
    _clone_pool,
    compare_with_ref,
    make_batch,
)
from .interpreter import run_checks, run_interpreted

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (CPU coverage: the interpreter test)"
)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_triton_matches_torch_ref(batch: str, heads: str, dtype: str) -> None:
    prefix_lens, extend_lens, mode = BATCHES[batch]
    h = HEADS[heads]
    for seed in (0, 1):
        b = make_batch(prefix_lens, extend_lens, mode, h, dtype=DTYPES[dtype], device="cuda", seed=seed)
        compare_with_ref("triton", b, h.q)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch_size", [1, 3, 64, 200])
def test_decode_split_count_does_not_change_result(batch_size: int) -> None:
    """Decode splits the keys by batch size; a request's result must not depend on its batch."""
    h = HEADS["gqa4_d128"]
    lens = [(97 * i) % 1500 + (2500 if i % 7 == 0 else 0) for i in range(batch_size)]  # ragged
    b = make_batch(
        lens,
        [1] * batch_size,
        BATCHES["decode_long"][2],
        h,
        dtype=torch.float32,
        device="cuda",
        seed=batch_size,
    )
    compare_with_ref("triton", b, h.q)


# Extend launch settings. The batch has prefixes that are and are not multiples of the key block
# (keys before a query block: whole unmasked blocks, then the causal ones), requests shorter than
# the query block and a last request whose final query block is partial.
KNOB_BATCH = ([0, 64, 37, 130, 5], [70, 5, 64, 1, 33])
# name -> (heads, block_size_m, block_n, heads_per_program); None: the launcher's default
KNOB_CASES: dict[str, tuple[Heads, int, int | None, int | None]] = {
    "mha_d64_m16_n16": (Heads(2, 2, 64), 16, 16, None),
    "gqa2_d64_m16_n32_h1": (Heads(4, 2, 64), 16, 32, 1),
    "gqa2_d64_m32_n16_h2": (Heads(4, 2, 64), 32, 16, 2),
    "gqa4_d64_m16_n16_h4": (Heads(8, 2, 64), 16, 16, 4),
    "gqa4_d128_m32_n32_h2": (Heads(8, 2, 128), 32, 32, 2),
    "gqa2_d80_m16_n16_h2": (Heads(4, 2, 80), 16, 16, 2),  # head dim padded to 128
    "gqa2_d64_default": (Heads(4, 2, 64), 64, None, None),
}
FP8_SCALES = (0.05, 0.02)


def check_extend_knobs(case: str, dtype: torch.dtype, fp8: bool, device: str, seed: int) -> float:
    """Run ``extend_attention`` with one ``KNOB_CASES`` setting against float64 ``torch_ref``.

    ``out`` has spare rows past the batch's tokens: they must stay untouched (the queries past a
    request's ``extend_lens`` are computed but never stored). An fp8 pool uses float16 dots.
    """
    from phloem.runtime.attention.registry import get_attention_backend_class
    from phloem.runtime.attention.triton_kernels import extend_attention, extend_block_table

    heads, block_size_m, block_n, heads_per_program = KNOB_CASES[case]
    b = make_batch(
        *KNOB_BATCH, ForwardMode.EXTEND, heads, dtype=dtype, device=device, seed=seed,
        kv_dtype=torch.float8_e4m3fn if fp8 else None, kv_scales=FP8_SCALES if fp8 else None,
    )  # fmt: skip
    fi = b.fi
    b.pool.set_kv(0, fi.out_slots, b.k, b.v)
    ref_pool = _clone_pool(b.pool, torch.float64)
    ref = get_attention_backend_class("torch_ref")(ref_pool, b.rtt, num_heads=heads.q)
    ref.init_metadata(fi)
    k_new, v_new = ref_pool.gather_kv(0, fi.out_slots, torch.float64)
    expect = ref.forward(b.q.double(), k_new, v_new, 0)

    t = fi.num_tokens
    spare = torch.full((t + 64, heads.q, heads.dim), float("nan"), dtype=dtype, device=device)
    k_buf, v_buf = b.pool.get_kv(0)
    k_scale, v_scale = b.pool.get_kv_scales(0)
    block_req, block_m = extend_block_table(fi.extend_lens, t, block_size_m)
    out = extend_attention(
        b.q, k_buf, v_buf, spare[:t],
        req_to_token=b.rtt.req_to_token, req_pool_indices=fi.req_pool_indices,
        prefix_lens=fi.prefix_lens, extend_lens=fi.extend_lens,
        q_start=torch.cumsum(fi.extend_lens, 0) - fi.extend_lens,
        block_req=block_req, block_m=block_m, sm_scale=heads.dim**-0.5, k_scale=k_scale,
        v_scale=v_scale, block_size_m=block_size_m, block_n=block_n,
        heads_per_program=heads_per_program, f16_dot=fp8 and dtype != torch.float32,
    )  # fmt: skip
    assert torch.isnan(spare[t:]).all(), "stored a row past the last request's queries"
    assert not torch.isnan(out).any(), "NaN in output (or a query row never stored)"
    err = float((out.double() - expect).norm() / expect.norm())
    assert err < REL_TOL[dtype], f"relative error {err:.3e} over {REL_TOL[dtype]:.0e}"
    return err


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", sorted(KNOB_CASES))
def test_extend_settings_match_torch_ref(case: str, dtype: str, fp8: bool) -> None:
    for seed in (0, 1):
        check_extend_knobs(case, DTYPES[dtype], fp8, "cuda", seed)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the compiled test above runs instead")
def test_extend_settings_under_interpreter() -> None:
    proc = run_interpreted("tests.kernels.test_attention_triton")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 4 * len(KNOB_CASES), proc.stdout


def main() -> int:
    """Every ``KNOB_CASES`` setting on the CPU (run with ``TRITON_INTERPRET=1``): float32 and
    float16 (the interpreter's bfloat16 dots are wrong), each over a pool of its own dtype and an
    fp8 one."""
    checks = [
        (f"{case} {dtype_name}{' fp8' if fp8 else ''}",
         lambda case=case, dtype=DTYPES[dtype_name], fp8=fp8: check_extend_knobs(case, dtype, fp8, "cpu", 3))
        for case in KNOB_CASES for dtype_name in ("fp32", "fp16") for fp8 in (False, True)
    ]  # fmt: skip
    return 1 if run_checks(checks) else 0


if __name__ == "__main__":
    sys.exit(main())
