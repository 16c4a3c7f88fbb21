"""Device time of a launch's decode steps: what ``policy.DecodePace`` sizes continuous decode by.

A launch's wall time has a fixed part (the host builds the launch, hands it over, reads its
tokens back) and a part per step. Dividing the whole of it by the steps charges the fixed part to
the steps: a short launch reads as slow steps, so the next launch is shorter still. Only the steps
are timed here: CUDA events on the stream around them, which also count any gap in which the GPU
waited for the host to queue the next step (a step's real cost where the host is the slower one),
or the wall clock on the CPU, where the work runs as it is queued.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from phloem.runtime.forward_io import StepTime


class StepTimer:
    def __init__(
        self, device: torch.device | str | None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.device = torch.device(device) if device is not None else None
        self.cuda = self.device is not None and self.device.type == "cuda"
        self.clock = clock

    def start(self) -> Any:
        """A mark before the steps are queued."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))  # the runner's device, whatever the thread's
            return event
        return self.clock()

    def stop(self, mark: Any, steps: int) -> StepTime:
        """The ``steps`` queued since ``mark``; read their time once their tokens are read."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))

            def read() -> float:
                end.synchronize()  # recorded after the tokens' copy: done once they are, or just after
                return mark.elapsed_time(end) / 1e3

            return StepTime(steps, read)
        seconds = self.clock() - mark
        return StepTime(steps, lambda: seconds)
