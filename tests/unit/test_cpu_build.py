"""The CPU kernels' prebuild (``python -m phloem.runtime.layers.cpu_build``, run in the background
by ``make test``): it covers every extension this CPU runs, each built in a process of its own."""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.layers import cpu_build, qdot

AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def test_jobs_name_every_extension_this_cpu_runs() -> None:
    names = set(cpu_build._jobs())
    assert names == {"cpu_decode", "quant", *(f"qdot_{isa}" for isa in qdot.supported_isas())}


@pytest.mark.skipif(not AVX2, reason="the CPU kernels need AVX2")
def test_build_all_builds_each_extension(monkeypatch) -> None:
    """One child process per extension, all started before any is waited for."""
    started = []
    real = cpu_build.subprocess.Popen

    def popen(cmd, *a, **kw):
        started.append(cmd[-1])
        return real(cmd, *a, **kw)

    monkeypatch.setattr(cpu_build.subprocess, "Popen", popen)
    built = cpu_build.build_all()
    assert sorted(started) == sorted(cpu_build._jobs())
    assert built == {name: True for name in cpu_build._jobs()}
