"""KV pool sizing: ``--mem-fraction-static`` of the device for weights + pool, less what other
processes hold on a shared GPU."""

from __future__ import annotations

from phloem.runtime.executor.model_runner import kv_budget_bytes

GIB = 2**30


def test_alone_on_the_device_the_fraction_rules():
    # 140 GiB device, 1 GiB of weights loaded, 139 GiB free: both bounds give 0.85 x 140 - 1
    assert kv_budget_bytes(140 * GIB, 139 * GIB, 0.85, 1 * GIB) == 0.85 * 140 * GIB - 1 * GIB


def test_a_shared_device_leaves_the_same_headroom():
    # another process holds 45 GiB: the pool shrinks by it, the 15% headroom stays free
    budget = kv_budget_bytes(140 * GIB, 94 * GIB, 0.85, 1 * GIB)
    assert budget == 94 * GIB - 0.15 * 140 * GIB
    assert 94 * GIB - budget >= 0.15 * 140 * GIB


def test_cpu_has_no_free_measurement():
    assert kv_budget_bytes(64 * GIB, None, 0.25, 2 * GIB) == 14 * GIB
