"""A forward pass never makes the host wait for the GPU (docs/design.md §5, the overlap loop).

The worker launches step N+1 while step N runs only if nothing in ``ModelRunner.forward`` waits
for the stream: a copy from pageable host memory (``cpu_tensor.to("cuda")``), ``.item()``,
``.cpu()`` or a ``nonzero`` would each hold the worker until the GPU drained, and the next pass
would then be prepared while the GPU sat idle. PyTorch's sync debug mode turns every such wait
inside a torch op into an error; each forward here runs once to warm up (first use compiles and
allocates) and once under it, for prefill (extend) and decode, eager and replayed from a CUDA
graph, and with logprobs asked for (their copy is queued with the tokens' and read after).
"""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.forward_io import LogprobRequest
from phloem.runtime.model_files import ModelSource

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _runner(graphs: bool) -> ModelRunner:
    return ModelRunner(
        ModelSource("dummy", "tiny-llama"), dtype="bfloat16", device="cuda", attention_backend="triton",
        max_total_tokens=1024, max_running_requests=4, cuda_graph_max_bs=4 if graphs else 0,
    )  # fmt: skip


def _no_sync(runner: ModelRunner, batcher: DirectBatcher, new: dict[int, list[int]], **kw) -> list[int]:
    """Build the batch (its ``req_to_token`` writes may wait), then run the forward under the
    sync debug mode; the tokens are read after it."""
    fi = batcher.build(new, **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = runner.forward(fi)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = out.synchronize()
    if kw.get("logprobs") is not None:
        assert out.logprobs is not None and len(out.logprobs) == len(tokens)
    return tokens


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_forward_never_waits_for_the_gpu(graphs: bool) -> None:
    runner = _runner(graphs)
    batcher = DirectBatcher(runner)
    for _ in range(2):  # the first round warms up; the second must not wait either
        a, b = batcher.new_sequence(), batcher.new_sequence()
        prompts = {a: list(range(3, 40)), b: list(range(50, 61))}
        first = _no_sync(runner, batcher, prompts)
        assert len(first) == 2
        ids = _no_sync(runner, batcher, {a: [first[0]], b: [first[1]]}, decode=True)
        assert len(ids) == 2
        batcher.release(a)
        batcher.release(b)


def test_forward_with_logprobs_never_waits_for_the_gpu() -> None:
    runner = _runner(graphs=False)
    batcher = DirectBatcher(runner)
    for _ in range(2):
        a = batcher.new_sequence()
        want = LogprobRequest(torch.tensor([True]), [3], [[5, 7]], input_logprob_starts=[2])
        first = _no_sync(runner, batcher, {a: list(range(3, 30))}, logprobs=want)
        each = LogprobRequest(torch.tensor([True]), [3], [None])
        _no_sync(runner, batcher, {a: first}, decode=True, logprobs=each)
        batcher.release(a)
