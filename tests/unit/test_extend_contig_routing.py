"""When the Triton backend's extend takes the contiguous-K/V kernel (``contiguous_extend_ok``).

Pure host logic over tensor metadata: no kernel runs here (the interpreter and GPU tests in
``tests/kernels`` check the kernel itself).
"""

from __future__ import annotations

import pytest
import torch

contig = pytest.importorskip("phloem.runtime.attention.triton_extend_contig")


def _qkv(t: int = 10, hq: int = 4, hk: int = 2, d: int = 64, dtype=torch.float16):
    """q, k, v as the model hands them over: views into one fused projection output."""
    qkv = torch.zeros(t, (hq + 2 * hk) * d, dtype=dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)


def _extend_backend(layers: int):
    """A Triton backend on CPU buffers, in an extend pass of 10 new tokens (the metadata tensors
    only need to exist: the kernels are stubbed)."""
    from phloem.runtime.attention import triton as backend_mod
    from phloem.runtime.cache.kv_pool import KVPool, ReqToTokenPool
    from phloem.runtime.forward_io import ForwardMode

    backend = backend_mod.TritonBackend(
        KVPool(layers, 16, 2, 64, torch.float16, "cpu"), ReqToTokenPool(1, 16, "cpu"), num_heads=4
    )
    backend.mode = ForwardMode.EXTEND
    backend.out_slots = torch.arange(1, 11)
    backend.req_pool_indices = backend.prefix_lens = backend.extend_lens = torch.zeros(1, dtype=torch.int64)
    backend.q_start = backend.block_req = backend.block_m = torch.zeros(1, dtype=torch.int64)
    return backend


@pytest.fixture
def contiguous_mode(monkeypatch):
    monkeypatch.setattr(contig, "MODE", "contiguous")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors qualify only under the interpreter


def test_off_unless_asked(monkeypatch) -> None:
    monkeypatch.setattr(contig, "MODE", "pool")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _qkv()
    assert not contig.contiguous_extend_ok(q, k, v, torch.zeros(5, 2, 64, dtype=torch.float16))


def test_fused_qkv_views_qualify(contiguous_mode) -> None:
    q, k, v = _qkv()
    assert contig.contiguous_extend_ok(q, k, v, torch.zeros(5, 2, 64, dtype=torch.float16))


def test_cpu_without_interpreter_keeps_the_pool_kernel(monkeypatch) -> None:
    monkeypatch.setattr(contig, "MODE", "contiguous")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _qkv()
    assert not contig.contiguous_extend_ok(q, k, v, torch.zeros(5, 2, 64, dtype=torch.float16))


@pytest.mark.parametrize(
    "case",
    ["fp8 pool", "float32", "head dim 48", "head dim 512", "k not row-contiguous", "odd row stride"],
)
def test_the_pool_kernel_keeps_what_a_descriptor_cannot_read(contiguous_mode, case: str) -> None:
    q, k, v = _qkv()
    k_buf = torch.zeros(5, 2, 64, dtype=torch.float16)
    if case == "fp8 pool":  # the decode reads fp8-rounded keys; so does the pool kernel
        k_buf = k_buf.to(torch.float8_e4m3fn)
    elif case == "float32":
        q, k, v = _qkv(dtype=torch.float32)
        k_buf = k_buf.float()
    elif case == "head dim 48":  # not a power of two
        q, k, v = _qkv(d=48)
        k_buf = torch.zeros(5, 2, 48, dtype=torch.float16)
    elif case == "head dim 512":
        q, k, v = _qkv(d=512)
        k_buf = torch.zeros(5, 2, 512, dtype=torch.float16)
    elif case == "k not row-contiguous":  # heads interleaved: [T, D, H] transposed
        k = torch.zeros(10, 64, 2, dtype=torch.float16).transpose(1, 2)
    elif case == "odd row stride":  # rows of 7 heads x 16 values + 4 spare: 232 bytes, not 16-aligned
        qkv = torch.zeros(10, 7 * 16 + 4, dtype=torch.float16)
        q, k, v = qkv[:, :48].view(10, 3, 16), qkv[:, 48:80].view(10, 2, 16), qkv[:, 80:112].view(10, 2, 16)
        k_buf = torch.zeros(5, 2, 16, dtype=torch.float16)
        assert k.data_ptr() % 16 == 0  # only the row stride is wrong
    assert not contig.contiguous_extend_ok(q, k, v, k_buf), case


def test_rows_2d_is_a_view_with_the_row_stride() -> None:
    _, k, _ = _qkv(t=6, hq=4, hk=2, d=64)
    rows = contig._rows_2d(k)
    assert rows is not None and rows.shape == (6, 128) and rows.stride() == (k.stride(0), 1)
    assert rows.data_ptr() == k.data_ptr()
    k.fill_(1.0)
    assert torch.all(rows == 1.0)


def test_block_n_must_divide_the_query_block() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="block_n"):
        contig.extend_attention_contiguous(
            q, k, v, k, v, torch.empty_like(q), req_to_token=torch.zeros(1, 10, dtype=torch.int64),
            req_pool_indices=torch.zeros(1, dtype=torch.int64), prefix_lens=torch.zeros(1, dtype=torch.int64),
            extend_lens=torch.tensor([10]), q_start=torch.zeros(1, dtype=torch.int64),
            block_req=torch.zeros(1, dtype=torch.int64), block_m=torch.zeros(1, dtype=torch.int64),
            sm_scale=0.125, block_n=128,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("env", "mode"), [(None, "contiguous"), ("pool", "pool"), ("contiguous", "contiguous"), ("flat", None)]
)
def test_mode_from_the_environment(monkeypatch, env: str | None, mode: str | None) -> None:
    """Contiguous by default; ``PHLOEM_EXTEND_KERNEL=pool`` opts out; any other value is an error
    naming the variable (read on each routing decision, not at import)."""
    monkeypatch.setattr(contig, "MODE", None)
    if env is None:
        monkeypatch.delenv("PHLOEM_EXTEND_KERNEL", raising=False)
    else:
        monkeypatch.setenv("PHLOEM_EXTEND_KERNEL", env)
    if mode is None:
        with pytest.raises(ValueError, match="PHLOEM_EXTEND_KERNEL"):
            contig.extend_mode()
    else:
        assert contig.extend_mode() == mode


def test_importing_never_reads_the_switch() -> None:
    """A bad value does not break ``import`` (the engine reads it when it routes a pass)."""
    import os
    import subprocess
    import sys

    environ = {**os.environ, "PHLOEM_EXTEND_KERNEL": "flat"}
    code = "import phloem.runtime.attention.triton_extend_contig"
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("contig_ok", [True, False], ids=["contiguous", "pool"])
def test_fused_rotate_and_extend_take_one_decision_per_layer(monkeypatch, contig_ok: bool) -> None:
    """A fused ``rotate`` rotates k in place exactly when the extend that follows reads the new
    keys from k (else the contiguous kernel would read unrotated keys), and the routing check runs
    once per layer, not once in each. Kernels are recorded, not run: this pins the host logic."""
    from phloem.runtime.attention import triton as backend_mod

    calls: list[str] = []

    def ok(*_args):
        calls.append("check")
        return contig_ok

    monkeypatch.setattr(backend_mod, "use_fused", lambda _x: True)
    monkeypatch.setattr(backend_mod, "contiguous_extend_ok", ok)
    monkeypatch.setattr(
        backend_mod, "rope_store_", lambda *a, k_inplace, **kw: calls.append(f"rope k_inplace={k_inplace}")
    )
    monkeypatch.setattr(
        backend_mod, "extend_attention_contiguous", lambda *a, **kw: calls.append("contiguous") or a[5]
    )
    monkeypatch.setattr(backend_mod, "extend_attention", lambda *a, **kw: calls.append("pool") or a[3])

    backend = _extend_backend(layers=2)
    q, k, v = _qkv()
    cos_sin = (torch.ones(10, 1, 32), torch.zeros(10, 1, 32))
    for layer in (0, 1):
        q, k = backend.rotate(q, k, v, cos_sin, layer)
        backend.forward_extend(q, k, v, layer)
    kernel = "contiguous" if contig_ok else "pool"
    assert calls == ["check", f"rope k_inplace={contig_ok}", kernel] * 2


@pytest.mark.parametrize(
    ("pairs", "tiles"),
    [
        (None, (32, 32)),  # no host counts (a batch built on the device): the default
        ((0, 11_046), (32, 32)),  # fresh prompts
        ((8_192 * 8_192, 8_192 * 8_193 // 2), (32, 32)),  # a long prompt's second chunk: ratio 2
        ((2 * 8_192 * 8_192, 8_192 * 8_193 // 2), (32, 32)),  # its third: just under 4 (the diagonal)
        ((3 * 8_192 * 8_192, 8_192 * 8_193 // 2), (64, 64)),  # its fourth: ~6
        ((4 * 8_256 - 1, 8_256), (32, 32)),
        ((4 * 8_256, 8_256), (64, 64)),
        ((16 * 2_048 * 128, 16 * 128 * 129 // 2), (64, 64)),  # 16 radix hits of 2,048 + 128: ratio 32
    ],
)
def test_extend_tiles_widen_for_prefix_heavy_passes(pairs, tiles) -> None:
    assert contig.extend_tiles(pairs) == tiles


def test_key_pairs_counted_on_the_host_travel_with_the_batch() -> None:
    from phloem.runtime.executor.model_runner import greedy_sampling_info
    from phloem.runtime.forward_io import ForwardInput, ForwardMode, extend_key_pairs

    prefix, extend = torch.tensor([0, 40, 5, 67]), torch.tensor([9, 1, 70, 130])
    # new tokens over their prefix, and over each other (causal, themselves included)
    assert extend_key_pairs(prefix, extend) == (40 + 350 + 67 * 130, 45 + 1 + 2_485 + 8_515)

    def batch(mode: ForwardMode, ext: torch.Tensor) -> ForwardInput:
        z = torch.zeros(int(ext.sum()), dtype=torch.int64)
        return ForwardInput(
            mode=mode, input_ids=z, positions=z, out_slots=z, req_pool_indices=torch.arange(4),
            seq_lens=prefix + ext, prefix_lens=prefix, extend_lens=ext, sampling=greedy_sampling_info(4),
        )  # fmt: skip

    fi = batch(ForwardMode.EXTEND, extend)
    assert fi.host_key_pairs() == extend_key_pairs(prefix, extend)
    assert fi.to("cpu").key_pairs == extend_key_pairs(prefix, extend)  # what the device copy keeps
    assert batch(ForwardMode.DECODE, torch.ones(4, dtype=torch.int64)).to("cpu").key_pairs is None


def test_the_backend_launches_the_tiles_of_its_batch(monkeypatch) -> None:
    """``init_metadata`` keeps the host's pair counts; the extend launch gets their tiles."""
    from phloem.runtime.attention import triton as backend_mod

    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(backend_mod, "contiguous_extend_ok", lambda *a: True)
    monkeypatch.setattr(
        backend_mod,
        "extend_attention_contiguous",
        lambda *a, block_n, block_prefix, **kw: seen.append((block_n, block_prefix)) or a[5],
    )
    backend = _extend_backend(layers=1)
    q, k, v = _qkv()
    for pairs in ((0, 55), (2_048 * 10, 55)):
        backend.key_pairs = pairs
        backend.forward_extend(q, k, v, 0)
    assert seen == [(32, 32), (64, 64)]
