"""The fp8 KV pool (``kv_cache_dtype="fp8_e4m3"``): storage, scales, sizing, and attention over it.

e4m3 keeps 3 mantissa bits, so a stored value is within 2^-4 of the original, relatively, or
within ``scale x 2^-10`` among the subnormals (``|x / scale| < 2^-6``); the tests hold the pool
to exactly that bound, then check how much of it reaches an attention output.
"""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.attention.registry import get_attention_backend_class
from phloem.runtime.cache.host_pool import HostKVPool, KVCopier, _raw
from phloem.runtime.cache.kv_pool import FP8_E4M3_MAX, KVPool
from phloem.runtime.config import EngineArgs
from phloem.runtime.executor import model_runner
from phloem.runtime.executor.model_runner import ModelRunner
from phloem.runtime.forward_io import ForwardMode
from phloem.runtime.launch import check_supported
from phloem.runtime.model_files import ModelSource

from tests.kernels.attention_cases import Heads, compare_with_ref, make_batch

FP8 = torch.float8_e4m3fn
HEADS = Heads(6, 2, 32)
# name -> (prefix_lens, extend_lens, mode)
CASES = {
    "extend_mixed": ([0, 30, 7], [12, 1, 25], ForwardMode.EXTEND),
    "decode": ([3, 60, 1, 17], [1, 1, 1, 1], ForwardMode.DECODE),
}


def fp8_pool(num_layers: int = 2, slots: int = 64, **scales) -> KVPool:
    return KVPool(num_layers, slots, HEADS.kv, HEADS.dim, FP8, "cpu", **scales)


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def assert_within_fp8_rounding(got: torch.Tensor, want: torch.Tensor, scale: float) -> None:
    bound = torch.maximum(want.abs() * 2**-4, torch.full_like(want, scale * 2**-10))
    excess = ((got - want).abs() - bound * (1 + 1e-6)).max()
    assert excess <= 0, f"an element is {float(excess):.3e} past the fp8 rounding bound"


# ---- the pool ---------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, 0.01, 4.0])
def test_round_trip_error_is_within_fp8_rounding(scale: float) -> None:
    gen = torch.Generator().manual_seed(0)
    pool = fp8_pool(k_scales=[scale, scale], v_scales=[scale, 2 * scale])
    slots = torch.randperm(63, generator=gen)[:40] + 1
    # magnitudes over several decades, all inside +-448 x scale
    k = torch.randn(40, HEADS.kv, HEADS.dim, generator=gen) * scale * 10.0 ** torch.randint(-3, 2, (40, 1, 1))
    v = torch.randn(40, HEADS.kv, HEADS.dim, generator=gen) * scale
    pool.set_kv(1, slots, k, v)
    got_k, got_v = pool.gather_kv(1, slots, torch.float32)
    assert got_k.dtype == torch.float32 and got_k.shape == k.shape
    assert_within_fp8_rounding(got_k, k, scale)
    assert_within_fp8_rounding(got_v, v, 2 * scale)
    # the raw buffers hold fp8(x / scale), what a kernel multiplies back by get_kv_scales (float32)
    raw_k, _ = pool.get_kv(1)
    k_scale, v_scale = pool.get_kv_scales(1)
    assert raw_k.dtype == FP8 and (k_scale, v_scale) == (f32(scale), f32(2 * scale))
    torch.testing.assert_close(raw_k[slots].float() * k_scale, got_k, rtol=0, atol=0)
    assert not pool.k_buffer[0].float().any(), "another layer was written"


def test_outliers_saturate_instead_of_turning_nan() -> None:
    pool = fp8_pool(k_scales=[0.5, 0.5], v_scales=[1.0, 1.0])
    k = torch.tensor([1e4, -1e4, 300.0, 0.0]).repeat_interleave(HEADS.kv * HEADS.dim // 4)
    k = k.reshape(1, HEADS.kv, HEADS.dim)
    pool.set_kv(0, torch.tensor([5]), k, k)
    got_k, got_v = pool.gather_kv(0, torch.tensor([5]), torch.float32)
    assert torch.isfinite(got_k).all() and torch.isfinite(got_v).all()
    assert got_k.max() == FP8_E4M3_MAX * 0.5 and got_k.min() == -FP8_E4M3_MAX * 0.5
    assert got_v.max() == FP8_E4M3_MAX and got_v.min() == -FP8_E4M3_MAX


def test_bf16_input_is_stored_like_float32_input() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, HEADS.kv, HEADS.dim, generator=gen).bfloat16()
    a, b = fp8_pool(), fp8_pool()
    a.set_kv(0, torch.arange(1, 9), x, x)
    b.set_kv(0, torch.arange(1, 9), x.float(), x.float())
    assert torch.equal(a.k_buffer[0].view(torch.uint8), b.k_buffer[0].view(torch.uint8))
    assert a.gather_kv(0, torch.arange(1, 9), torch.bfloat16)[0].dtype == torch.bfloat16


def test_scales_default_to_one_and_are_validated() -> None:
    pool = fp8_pool()
    assert [pool.get_kv_scales(i) for i in range(2)] == [(1.0, 1.0), (1.0, 1.0)]
    from_tensor = fp8_pool(k_scales=torch.tensor([0.5, 0.25]), v_scales=(2.0, 3.0))
    assert from_tensor.get_kv_scales(1) == (0.25, 3.0)
    assert from_tensor.k_scales.dtype == torch.float32
    for bad in ([1.0], [1.0, 0.0], [1.0, float("nan")], [-1.0, 1.0]):
        with pytest.raises(ValueError):
            fp8_pool(k_scales=bad)
    with pytest.raises(ValueError, match="fp8"):
        KVPool(2, 8, 2, 32, torch.bfloat16, "cpu", k_scales=[1.0, 1.0])


def test_non_fp8_pools_are_unchanged() -> None:
    pool = KVPool(1, 8, 2, 4, torch.float32, "cpu")
    assert not pool.is_fp8 and pool.get_kv_scales(0) == (1.0, 1.0)
    x = torch.randn(3, 2, 4)
    pool.set_kv(0, torch.tensor([1, 2, 3]), x, -x)
    k, v = pool.gather_kv(0, torch.tensor([[1, 2], [3, 0]]), torch.float64)  # any index shape
    assert (
        k.shape == (2, 2, 2, 4)
        and torch.equal(k[0, 0], x[0].double())
        and torch.equal(v[1, 0], -x[2].double())
    )


def test_bytes_per_token_is_one_byte_per_element() -> None:
    # SmolLM2-135M: 3 KV heads x 64 x 2 (K, V) x 30 layers; docs/design.md §3 gives 23,040 in bf16
    fp8 = KVPool.bytes_per_token_for(30, 3, 64, FP8)
    assert fp8 == 3 * 64 * 2 * 30 == 11520
    assert 2 * fp8 == KVPool.bytes_per_token_for(30, 3, 64, torch.bfloat16)
    assert 4 * fp8 == KVPool.bytes_per_token_for(30, 3, 64, torch.float32)
    assert KVPool(30, 4, 3, 64, FP8, "cpu").bytes_per_token == 11520


def test_model_runner_fits_more_fp8_tokens_in_the_same_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same memory budget, float32 compute: the fp8 pool holds 4x the tokens of the float32 one."""
    monkeypatch.setattr(model_runner, "_device_memory", lambda device: 2_000_000)

    def runner(kv: str) -> ModelRunner:
        return ModelRunner(ModelSource("dummy", "tiny-llama"), dtype="float32", device="cpu",
                           mem_fraction_static=1.0, max_running_requests=2, kv_cache_dtype=kv)  # fmt: skip

    auto, fp8 = runner("auto"), runner("fp8_e4m3")
    assert auto.kv_pool.dtype == torch.float32 and fp8.kv_pool.dtype == FP8 and fp8.kv_dtype == FP8
    assert fp8.max_total_num_tokens // 4 == auto.max_total_num_tokens > 1000
    assert fp8.kv_pool.size == fp8.max_total_num_tokens
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        runner("fp8_e5m2")


def test_launch_accepts_fp8_and_refuses_the_rest() -> None:
    check_supported(EngineArgs(kv_cache_dtype="fp8_e4m3"))
    check_supported(EngineArgs(kv_cache_dtype="fp8_e4m3", attention_backend="triton"))
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        check_supported(EngineArgs(kv_cache_dtype="int8"))
    with pytest.raises(ValueError, match="flashinfer"):
        check_supported(EngineArgs(kv_cache_dtype="fp8_e4m3", attention_backend="flashinfer"))


# ---- host tier --------------------------------------------------------------------------------
def test_host_pool_copies_fp8_bytes_unchanged() -> None:
    gen = torch.Generator().manual_seed(2)
    device = fp8_pool()
    x = torch.randn(10, HEADS.kv, HEADS.dim, generator=gen)
    dev_slots = torch.arange(20, 30)
    for layer in range(2):
        device.set_kv(layer, dev_slots, x * (layer + 1), -x)
    host = HostKVPool.like(device, 16)
    assert host.dtype == FP8 and host.bytes_per_token == device.bytes_per_token
    host_slots = torch.arange(3, 13)
    KVCopier().to_host(device, dev_slots, host, host_slots)
    gathered = host.gather(host_slots)  # [layers, 2, T, kv_heads, head_dim]
    back = torch.arange(40, 50)
    KVCopier().to_device(host, host_slots, device, back)
    for layer in range(2):
        want = device.k_buffer[layer][dev_slots].view(torch.uint8)
        assert torch.equal(device.k_buffer[layer][back].view(torch.uint8), want)
        assert torch.equal(gathered[layer, 0].view(torch.uint8), want)
    # the byte view the CUDA copier scatters with (index_copy_ has no float8 kernel)
    _raw(host.k_buffer[0]).index_copy_(0, torch.tensor([14]), _raw(device.k_buffer[1][20:21]))
    assert torch.equal(host.k_buffer[0][14].view(torch.uint8), device.k_buffer[1][20].view(torch.uint8))


def test_storage_tier_keeps_fp8_pages(tmp_path) -> None:
    from phloem.runtime.cache.storage import FileKVStorage

    store = FileKVStorage(str(tmp_path), model_id="fp8", num_layers=2, num_kv_heads=HEADS.kv,
                          head_dim=HEADS.dim, dtype=FP8, page_size=4)  # fmt: skip
    k = torch.randn(2, 4, HEADS.kv, HEADS.dim).to(FP8)
    store.put("page", k, (-k.float()).to(FP8))
    assert store.wait_writes(timeout=10)
    got = store.get("page")
    store.close()
    assert got is not None and got[0].dtype == FP8
    assert torch.equal(got[0].view(torch.uint8), k.view(torch.uint8))


# ---- attention over an fp8 pool -----------------------------------------------------------------
def fp8_batch(case: str, *, dtype: torch.dtype = torch.float32, seed: int = 3):
    prefix, extend, mode = CASES[case]
    return make_batch(prefix, extend, mode, HEADS, dtype=dtype, device="cpu", seed=seed,
                      kv_dtype=FP8, kv_scales=(0.05, 0.02))  # fmt: skip


def attend(backend_cls: type, batch) -> torch.Tensor:
    backend = backend_cls(batch.pool, batch.rtt, num_heads=HEADS.q)
    backend.init_metadata(batch.fi)
    return backend.forward(batch.q, batch.k, batch.v, 0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_ref_reads_the_dequantized_pool(case: str) -> None:
    """Against a float64 oracle over the same dequantized values: only float rounding is left."""
    assert compare_with_ref("torch_ref", fp8_batch(case), HEADS.q) < 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_batch_invariant_matches_torch_ref_on_fp8(case: str) -> None:
    from phloem.runtime.attention.batch_invariant import BatchInvariantBackend

    ref = attend(get_attention_backend_class("torch_ref"), fp8_batch(case))
    out = attend(BatchInvariantBackend, fp8_batch(case))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_attention_stays_close_to_full_precision(case: str, dtype: torch.dtype) -> None:
    """What fp8 storage costs: torch_ref over an fp8 pool vs over a pool of the compute dtype,
    same inputs. Measured on these random batches (seeds 0-3): 2.8-3.7% relative error in the
    output (fp8 rounds each K and V element by up to 6%)."""
    prefix, extend, mode = CASES[case]
    outs = []
    for kv_dtype in (dtype, FP8):
        b = make_batch(prefix, extend, mode, HEADS, dtype=dtype, device="cpu", seed=4, kv_dtype=kv_dtype)
        backend = get_attention_backend_class("torch_ref")(b.pool, b.rtt, num_heads=HEADS.q)
        backend.init_metadata(b.fi)
        outs.append(backend.forward(b.q, b.k, b.v, 0).double())
    full, fp8 = outs
    err = float((fp8 - full).norm() / full.norm())
    assert 1e-3 < err < 0.05, f"relative error {err:.3e}"
