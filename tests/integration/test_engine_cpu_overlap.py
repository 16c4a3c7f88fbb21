"""The overlap loop on the CPU is opt-in (``--enable-cpu-overlap-schedule``): the default Engine
on the CPU runs the inline loop, the flag turns the worker thread on, and both give the same
greedy tokens on the default model."""

from __future__ import annotations

from phloem import Engine

PROMPTS = ["The capital of France is", "List three colours:", "def add(a, b):", "Once upon a time"]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}  # every row runs 24 steps


def _run(**kw):
    with Engine(device="cpu", log_level="warning", **kw) as eng:
        info = eng.get_server_info()
        outs = eng.generate(PROMPTS, sampling_params=GREEDY)
        return info, [o["output_ids"] for o in outs]


def test_cpu_overlap_is_opt_in_and_gives_the_same_tokens():
    info_default, ids_default = _run()
    info_overlap, ids_overlap = _run(enable_cpu_overlap_schedule=True)
    assert info_default["overlap_schedule"] is False
    assert info_default["gemm_library"] == "cpu"  # --gemm-library picks nothing off CUDA
    assert info_overlap["overlap_schedule"] is True
    assert all(len(ids) == 24 for ids in ids_default)
    assert ids_overlap == ids_default
