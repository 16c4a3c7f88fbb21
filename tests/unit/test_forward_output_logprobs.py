"""``ForwardOutput.logprobs``: built once, from host copies, after the forward's event fired.

The forward only queues the copies (so it never waits for the GPU); whoever reads the logprobs
waits for ``copy_done`` first. A recording event stands in for the CUDA one."""

from __future__ import annotations

import torch
from phloem.runtime.forward_io import ForwardOutput, TokenLogprobs


class _Event:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("wait")


def test_built_once_after_the_event() -> None:
    log: list[str] = []

    def build() -> list[TokenLogprobs]:
        log.append("build")
        return [TokenLogprobs(output_logprob=-0.5)]

    ids = torch.tensor([3])
    out = ForwardOutput(ids, ids, copy_done=_Event(log), logprobs_fn=build)  # type: ignore[arg-type]
    assert log == []  # nothing waits or builds until asked
    first = out.logprobs
    assert first is not None and first[0].output_logprob == -0.5
    assert out.logprobs is first
    assert log == ["wait", "build"]


def test_none_when_not_asked() -> None:
    ids = torch.tensor([3])
    assert ForwardOutput(ids, ids).logprobs is None
