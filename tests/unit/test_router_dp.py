"""``phloem serve --dp-size``: the worker commands, and where dp_size > 1 is refused."""

from __future__ import annotations

import sys

import pytest
from phloem.runtime.config import EngineArgs
from phloem.runtime.launch import check_parallel, check_supported
from phloem.runtime.router.dp import worker_argv


def test_workers_get_the_same_options_their_own_port_and_their_own_gpus():
    args = EngineArgs(
        dp_size=4, tp_size=1, base_gpu_id=2, port=8000, host="0.0.0.0", max_total_tokens=4096,
        enable_mixed_chunk=True, api_key="k", device="cuda",
    )  # fmt: skip
    argv = worker_argv(args, port=41000, index=3)
    assert argv[:4] == [sys.executable, "-m", "phloem", "serve"]
    flags = argv[4:]
    assert "--dp-size" not in flags  # each worker is one replica
    assert flags[flags.index("--max-total-tokens") + 1] == "4096"
    assert "--enable-mixed-chunk" in flags
    assert flags[flags.index("--api-key") + 1] == "k"
    assert flags[flags.index("--device") + 1] == "cuda"
    assert flags[flags.index("--host") + 1] == "127.0.0.1"  # the router holds the public address
    assert flags[flags.index("--port") + 1] == "41000"
    assert flags[flags.index("--base-gpu-id") + 1] == "5"  # 2 + 3 * tp_size 1
    assert flags.count("--port") == 1 and flags.count("--host") == 1


def test_gpu_ids_step_by_the_tensor_parallel_size():
    args = EngineArgs(dp_size=2, tp_size=4)
    argv = worker_argv(args, port=1, index=1)
    assert argv[argv.index("--base-gpu-id") + 1] == "4"
    assert argv[argv.index("--tp-size") + 1] == "4"


def test_dp_size_passes_the_layout_check_but_an_engine_is_one_replica():
    check_parallel(EngineArgs(dp_size=4))
    check_parallel(EngineArgs(dp_size=2, tp_size=2))  # two replicas of two ranks each
    with pytest.raises(ValueError, match="--dp-size runs its replicas on this machine"):
        check_parallel(EngineArgs(dp_size=2, dist_init_addr="10.0.0.1:29500"))
    with pytest.raises(ValueError, match="--dp-size must be >= 1"):
        check_parallel(EngineArgs(dp_size=0))
    with pytest.raises(ValueError, match=r"phloem serve --dp-size 2'"):
        check_supported(EngineArgs(dp_size=2))
