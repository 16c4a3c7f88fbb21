"""The stop-flag kernel of early exit (``decode_exit_triton``) against its torch reference
(``decode_exit.stop_flags_reference``), and a decode graph's IF node skipping its forward."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("batch,width", [(1, 1), (5, 3), (33, 2), (130, 4)])
def test_kernel_matches_the_reference(batch, width) -> None:
    from phloem.runtime.executor.decode_exit import stop_flags_reference
    from phloem.runtime.executor.decode_exit_triton import stop_flags

    gen = torch.Generator().manual_seed(batch)
    for trial in range(20):
        rows = torch.randperm(300, generator=gen)[:batch]
        tags = torch.randint(1, 50, (batch,), generator=gen)
        stops = torch.randint(-1, 12, (batch, width), generator=gen)
        done = torch.where(
            torch.rand(300, generator=gen) < 0.3, torch.randint(1, 50, (300,), generator=gen), 0
        )
        if trial % 3 == 0:  # most rows already stopped: go turns on a handful
            done[rows] = tags
        tokens = torch.randint(0, 12, (batch,), generator=gen) if trial % 4 else None
        want_done = done.clone()
        want_go = stop_flags_reference(want_done, rows, tags, stops, tokens)
        dev = [t.cuda() if t is not None else None for t in (done, rows, tags, stops, tokens)]
        go = torch.ones((), dtype=torch.bool, device="cuda")
        skipped = torch.zeros((), dtype=torch.int64, device="cuda")
        stop_flags(dev[0], dev[1], dev[2], dev[3], dev[4], go, skipped, count=True)
        assert torch.equal(dev[0].cpu(), want_done), trial
        assert bool(go) == bool(want_go) and int(skipped) == int(not want_go), trial


def test_a_gated_graph_skips_its_work_while_go_is_false() -> None:
    from phloem.runtime.executor.decode_exit import DecodeExit, conditional_graphs_supported

    if not conditional_graphs_supported():
        pytest.skip("this torch or CUDA cannot capture conditional nodes")
    exit = DecodeExit(4, torch.device("cuda"))
    x = torch.zeros(1024, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        (x + 1).sum()  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            with exit.gated():
                x.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    rows, tags, stops = (torch.tensor(v, device="cuda") for v in ([2], [7], [[3]]))
    exit.update(rows, tags, stops)
    graph.replay()
    exit.update(rows, tags, stops, torch.tensor([3], device="cuda"))  # the row stops
    graph.replay()
    graph.replay()
    exit.open()
    graph.replay()
    torch.cuda.synchronize()
    assert int(x[0]) == 2 and exit.skipped == 1
