"""The decode pace's device timer on CUDA (``executor.step_timer``): events around queued work
time that work on the stream, not the host's queuing of it, and reading them after the work's
result needs no wait of its own."""

from __future__ import annotations

import math
import time

import pytest
import torch
from phloem.runtime.executor.step_timer import StepTimer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_step_timer_times_the_queued_work_on_the_stream():
    timer = StepTimer("cuda")
    assert timer.cuda
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    mark = timer.start()
    for _ in range(20):
        a = a @ a / 2048
    took = timer.stop(mark, 20)
    result = a.sum().item()  # the host waits for the work here, as a launch's token read does
    wall = time.perf_counter() - t0
    seconds = took.read()
    assert took.steps == 20 and math.isfinite(result)
    assert 0 < seconds <= wall


def test_an_idle_gap_before_the_mark_is_not_counted():
    timer = StepTimer("cuda")
    torch.cuda.synchronize()
    time.sleep(0.05)  # the device idles; nothing queued
    mark = timer.start()
    x = torch.ones(1024, device="cuda") * 2
    took = timer.stop(mark, 1)
    x.sum().item()
    assert took.read() < 0.05
