"""The programmatic-dependent-launch switch (``runtime/layers/pdl.py``): never on the CPU or when
switched off; the launch options follow the flag. Its effect on results is covered by every
GPU kernel test (the kernels run with PDL on by default on Hopper)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from phloem.runtime.layers import pdl  # noqa: E402


@pytest.fixture
def restore_switch():
    before = pdl._switch
    yield
    pdl._switch = before


def test_off_on_the_cpu_and_when_switched_off(restore_switch) -> None:
    pdl.set_pdl(True)
    assert not pdl.pdl_enabled(torch.device("cpu"))
    pdl.set_pdl(False)
    assert not pdl.pdl_enabled(torch.device("cuda", 0)), "switched off: no device query at all"


def test_environment_switch(monkeypatch, restore_switch) -> None:
    pdl._switch = None
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.pdl_enabled(torch.device("cuda", 0))
    assert pdl._switch is False


def test_launch_options_follow_the_flag() -> None:
    assert pdl.launch_kwargs(True) == {"launch_pdl": True}
    assert pdl.launch_kwargs(False) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_for_hopper_when_switched_on(restore_switch) -> None:
    pdl.set_pdl(True)
    hopper = torch.cuda.get_device_capability(0)[0] >= 9
    assert pdl.pdl_enabled(torch.device("cuda", 0)) == hopper
