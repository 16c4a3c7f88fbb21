"""The one-row norm + projection kernel (``runtime/layers/row_fused.py``) against torch, on fresh
random inputs.

Shared by ``test_row_fused.py`` (compiled kernel on CUDA) and, run as a script, by Triton's CPU
interpreter (``python -m tests.kernels.row_fused_cases`` with ``TRITON_INTERPRET=1``, in a child
process). The oracle is the unfused math in float32: ``h = x + residual`` rounded as a 16-bit add
rounds it, ``rms_norm`` of ``h`` (not rounded), ``F.linear``, ``silu(gate) * up``; only the output
is rounded. The kernel writes into fresh ``torch.empty`` outputs, so an element it failed to write
shows up as a mismatch.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from .fused_cases import INTERPRETER_BF16_TOL, REL_TOL, _interpreted, check_close
from .interpreter import interpreted_main, run_checks

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (N, K) of the stacked weight: SmolLM2-135M qkv and gate/up, Llama-3-8B qkv and gate/up, ragged
SHAPES = [(960, 576), (3072, 576), (6144, 4096), (28672, 4096), (1002, 700)]
SMALL_SHAPES = [(40, 70), (96, 128), (18, 300)]  # small enough for the interpreter
# (residual, bias, glu): the first layer's qkv, later layers' qkv, Qwen2's biased qkv, gate/up
VARIANTS = [(False, False, False), (True, False, False), (True, True, False), (True, False, True)]
# (q heads, kv heads, head dim, K) of the norm + qkv + RoPE + K/V store kernel: SmolLM2-135M,
# Llama-3-8B, and small ones for the interpreter
ROPE_SHAPES = [(9, 3, 64, 576), (32, 8, 128, 4096), (4, 2, 64, 300)]
SMALL_ROPE_SHAPES = [(2, 1, 8, 40), (3, 1, 16, 70)]
ROPE_VARIANTS = [(False, False), (True, False), (True, True)]  # (residual, bias)


def reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    g: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    b: torch.Tensor | None,
    glu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.nn.functional as F

    h = x + residual if residual is not None else x  # rounds like the kernel's add
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * g.float()
    y = F.linear(normed, w.float(), None if b is None else b.float())
    if glu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y.to(x.dtype), h


def check_norm_linear(
    shape: tuple[int, int], dtype: torch.dtype, device: str, seed: int, variant: tuple[bool, bool, bool]
) -> float:
    from phloem.runtime.layers.row_fused import norm_linear_row

    has_res, has_bias, glu = variant
    gen = torch.Generator(device=device).manual_seed(seed)
    n, k = shape

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device) * scale).to(dtype)

    x, res = randn(1, k), randn(1, k, scale=4.0) if has_res else None
    g = (1 + 0.3 * torch.randn(k, generator=gen, device=device)).to(dtype)
    w, b = randn(n, k, scale=k**-0.5), randn(n) if has_bias else None
    eps = 1e-5 if seed % 2 else 1e-6
    before = (x.clone(), None if res is None else res.clone())
    y, h = norm_linear_row(x, res, g, eps, w, b, glu=glu)
    ref_y, ref_h = reference(x, res, g, eps, w, b, glu)
    assert torch.equal(x, before[0]) and (res is None or torch.equal(res, before[1])), "inputs changed"
    if res is None:
        assert h.data_ptr() == x.data_ptr(), "without a residual the sum is x itself"
    elif dtype != torch.bfloat16 or not _interpreted():  # the interpreter truncates bf16
        assert torch.equal(h, ref_h), "x + residual differs from the plain add"
    tol = INTERPRETER_BF16_TOL if (_interpreted() and dtype == torch.bfloat16) else REL_TOL[dtype]
    return check_close(f"norm_linear {variant}", y, ref_y, tol)


def check_norm_qkv_rope(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: str,
    seed: int,
    variant: tuple[bool, bool],
    kv_dtype: torch.dtype | None = None,
) -> float:
    """``norm_qkv_rope_row`` against :func:`reference` (the projection), then rotate-half RoPE
    in float32 on the rounded projection and the K/V write (quantized as ``KVPool`` quantizes
    for an fp8 pool); every pool slot but the row's stays as it was."""
    from phloem.runtime.layers.row_fused import norm_qkv_rope_row

    hq, hk, d, k = shape
    has_res, has_bias = variant
    gen = torch.Generator(device=device).manual_seed(seed)
    n = (hq + 2 * hk) * d

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device) * scale).to(dtype)

    x, res = randn(1, k), randn(1, k, scale=4.0) if has_res else None
    g = (1 + 0.3 * torch.randn(k, generator=gen, device=device)).to(dtype)
    w, b = randn(n, k, scale=k**-0.5), randn(n) if has_bias else None
    angle = torch.rand(d // 2, generator=gen, device=device) * 6.0
    cos, sin = angle.cos().view(1, 1, -1), angle.sin().view(1, 1, -1)
    kv_dtype = kv_dtype or dtype
    scales = (0.05, 0.02) if kv_dtype != dtype else (1.0, 1.0)
    slots = 5
    k_buf = torch.full((slots, hk, d), 0.5, device=device).to(kv_dtype)
    v_buf = torch.full((slots, hk, d), -0.5, device=device).to(kv_dtype)
    before = (k_buf.clone(), v_buf.clone())
    slot = torch.tensor([3], device=device)
    q, h = norm_qkv_rope_row(x, res, g, 1e-6, w, b, cos, sin, k_buf, v_buf, slot, num_q_heads=hq,
                             k_scale=scales[0], v_scale=scales[1])  # fmt: skip
    y, ref_h = reference(x, res, g, 1e-6, w, b, glu=False)
    yq, yk, yv = y.float().view(-1, d).split([hq, hk, hk])
    c, s_ = cos.view(1, -1), sin.view(1, -1)

    def rope(t: torch.Tensor) -> torch.Tensor:
        t1, t2 = t[:, : d // 2], t[:, d // 2 :]
        return torch.cat([t1 * c - t2 * s_, t2 * c + t1 * s_], dim=-1).to(dtype)

    def stored(t: torch.Tensor, scale: float) -> torch.Tensor:
        if kv_dtype == dtype:
            return t
        return (t.float() / scale).clamp(-448, 448).to(kv_dtype)

    if res is not None and (dtype != torch.bfloat16 or not _interpreted()):
        assert torch.equal(h, ref_h), "x + residual differs from the plain add"
    untouched = [i for i in range(slots) if i != 3]
    assert torch.equal(k_buf[untouched].float(), before[0][untouched].float()), "other K slots changed"
    assert torch.equal(v_buf[untouched].float(), before[1][untouched].float()), "other V slots changed"
    tol = INTERPRETER_BF16_TOL if (_interpreted() and dtype == torch.bfloat16) else REL_TOL[dtype]
    err = check_close("q", q, rope(yq).view(1, -1), tol)
    if kv_dtype == dtype:
        err = max(
            err, check_close("k", k_buf[3], rope(yk), tol), check_close("v", v_buf[3], yv.to(dtype), tol)
        )
    else:  # fp8: within one e4m3 step (3 mantissa bits) of the quantized oracle
        for name, got, want, sc in (
            ("k", k_buf[3], rope(yk), scales[0]),
            ("v", v_buf[3], yv.to(dtype), scales[1]),
        ):
            ref8 = stored(want, sc).float()
            diff = (got.float() - ref8).abs()
            assert bool((diff <= ref8.abs() / 8 + 2**-6).all()), (
                f"fp8 {name}: max diff {float(diff.max()):.3g}"
            )
    return err


def check_rejects(device: str) -> None:
    from phloem.runtime.layers.row_fused import norm_linear_row

    w = torch.zeros(8, 32, dtype=torch.float16, device=device)
    g = torch.ones(32, dtype=torch.float16, device=device)
    x = torch.zeros(1, 32, dtype=torch.float16, device=device)
    bad = [
        (torch.zeros(2, 32, dtype=torch.float16, device=device), None, w, None, False, "x must be"),
        (x, torch.zeros(1, 31, dtype=torch.float16, device=device), w, None, False, "residual"),
        (x, None, w.float(), None, False, "dtype"),
        (x, None, w, w[:, 0], True, "glu"),
        (x, None, w[:7], None, True, "glu"),
    ]
    for xx, res, ww, bb, glu, word in bad:
        try:
            norm_linear_row(xx, res, g, 1e-6, ww, bb, glu=glu)
        except ValueError as exc:
            assert word in str(exc), f"message {exc!r} does not name {word!r}"
        else:
            raise AssertionError(f"no ValueError for a bad call ({word})")


def check_rope_rejects(device: str) -> None:
    """``norm_qkv_rope_row`` names what is wrong: heads that do not add up to the weight, a pool
    of another layout or dtype, tables of the wrong size."""
    from phloem.runtime.layers.row_fused import norm_qkv_rope_row

    f16 = torch.float16
    x, g = torch.zeros(1, 32, dtype=f16, device=device), torch.ones(32, dtype=f16, device=device)
    w = torch.zeros(4 * 8, 32, dtype=f16, device=device)  # 2 q heads + 2 x 1 kv head of 8
    kv = torch.zeros(3, 1, 8, dtype=f16, device=device)
    cs = torch.ones(4, device=device)
    slot = torch.zeros(1, dtype=torch.int64, device=device)
    bad = [
        (dict(num_q_heads=3), "q heads"),
        (dict(k_buf=torch.zeros(3, 8, dtype=f16, device=device)), "k_buf"),
        (dict(k_buf=kv.float(), v_buf=kv.float()), "pool dtype"),
        (dict(cos=torch.ones(3, device=device)), "cos"),
        (dict(x=torch.zeros(2, 32, dtype=f16, device=device)), "x must be"),
    ]
    for change, word in bad:
        args = dict(x=x, k_buf=kv, v_buf=kv, cos=cs, num_q_heads=2) | change
        try:
            norm_qkv_rope_row(args["x"], None, g, 1e-6, w, None, args["cos"], cs, args["k_buf"], args["v_buf"],
                              slot, num_q_heads=args["num_q_heads"])  # fmt: skip
        except ValueError as exc:
            assert word in str(exc), f"message {exc!r} does not name {word!r}"
        else:
            raise AssertionError(f"no ValueError for a bad call ({word})")


def run_small(device: str = "cpu") -> int:
    """Every small case; prints one line per case, returns the number of failures."""
    checks = [
        (f"norm_linear {shape} {variant} {dn}", partial(check_norm_linear, shape, dt, device, 3, variant))
        for shape in SMALL_SHAPES
        for variant in VARIANTS
        for dn, dt in DTYPES.items()
    ]
    checks += [
        (f"norm_qkv_rope {shape} {variant} {dn}", partial(check_norm_qkv_rope, shape, dt, device, 3, variant))
        for shape in SMALL_ROPE_SHAPES
        for variant in ROPE_VARIANTS
        for dn, dt in DTYPES.items()
    ]
    rejects = [
        ("rejects", partial(check_rejects, device)),
        ("rope rejects", partial(check_rope_rejects, device)),
    ]
    return run_checks([*checks, *rejects])


if __name__ == "__main__":
    sys.exit(interpreted_main(run_small))
