"""Host-to-device copies: packed per dtype, values and shapes kept, and (on a GPU) the host does
not wait for work already queued on the stream."""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.executor.model_runner import greedy_sampling_info
from phloem.runtime.forward_io import ForwardInput, ForwardMode, LogprobRequest
from phloem.runtime.host_copy import PACK_ALIGN_BYTES, _with_padding, pack_layout, pack_to_device, to_device

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _mixed() -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, 100, (7,), generator=g),
        None,
        torch.rand(3, 5, generator=g),
        torch.randint(0, 9, (2, 4), generator=g, dtype=torch.int32),
        torch.tensor([True, False, True]),
        torch.empty(0, dtype=torch.int64),
        torch.randint(0, 100, (4,), generator=g),
    ]


def _fi() -> ForwardInput:
    ids = torch.tensor([5, -3, 7])
    return ForwardInput(
        mode=ForwardMode.DECODE, input_ids=ids, positions=torch.tensor([4, 9, 2]),
        out_slots=torch.tensor([11, 12, 13]), req_pool_indices=torch.tensor([0, 2, 1]),
        seq_lens=torch.tensor([5, 10, 3]), prefix_lens=torch.tensor([4, 9, 2]),
        extend_lens=torch.ones(3, dtype=torch.int64), sampling=greedy_sampling_info(3),
        logprobs=LogprobRequest(torch.tensor([True, False, False]), [0, 2, 0], [None, None, [1]]),
    )  # fmt: skip


def _same(a: ForwardInput, b: ForwardInput) -> None:
    for name in (
        "input_ids",
        "positions",
        "out_slots",
        "req_pool_indices",
        "seq_lens",
        "prefix_lens",
        "extend_lens",
    ):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name
    for name, v in vars(a.sampling).items():
        w = getattr(b.sampling, name)
        assert torch.equal(v.cpu(), w.cpu()) if isinstance(v, torch.Tensor) else v == w, name
    assert a.logprobs is not None and b.logprobs is not None
    assert torch.equal(a.logprobs.return_logprob.cpu(), b.logprobs.return_logprob.cpu())
    assert a.logprobs.top_logprobs_nums == b.logprobs.top_logprobs_nums


def test_cpu_target_keeps_values() -> None:
    src = _mixed()
    out = pack_to_device(src, torch.device("cpu"))
    for a, b in zip(src, out):
        assert (a is None and b is None) or torch.equal(a, b)
    t = torch.arange(4)
    assert to_device(t, torch.device("cpu")) is t
    fi = _fi()
    _same(fi, fi.to("cpu"))


@pytest.mark.gpu
@needs_cuda
def test_cuda_pack_values_shapes_and_views() -> None:
    dev = torch.device("cuda")
    src = _mixed()
    big = torch.rand(300, 300).pin_memory()  # pinned and large: copied on its own
    already = torch.arange(5, device=dev)
    out = pack_to_device([*src, big, already], dev)
    for a, b in zip([*src, big, already], out):
        if a is None:
            assert b is None
            continue
        assert b is not None and b.device.type == "cuda" and b.dtype == a.dtype and b.shape == a.shape
        assert torch.equal(a.cpu(), b.cpu())
    assert out[-1] is already
    # the int64 tensors share one device buffer (one copy)
    i64 = [o for o, a in zip(out, src) if a is not None and a.dtype == torch.int64 and a.numel()]
    assert i64[0].untyped_storage().data_ptr() == i64[1].untyped_storage().data_ptr()
    # every packed view starts 16-byte aligned, whatever was packed before it (Triton specializes)
    assert all(o.data_ptr() % PACK_ALIGN_BYTES == 0 for o in out if o is not None and o.numel())
    _same(_fi(), _fi().to(dev))


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_pack_layout_aligns_every_part(itemsize: int) -> None:
    sizes = [7, 0, 1, 3, 16, 5, 2]
    offsets, total = pack_layout(sizes, itemsize)
    step = max(1, PACK_ALIGN_BYTES // itemsize)
    assert all(off * itemsize % PACK_ALIGN_BYTES == 0 for off in offsets)
    ends = [off + n for off, n in zip(offsets, sizes)]
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:]))  # no overlap, in order
    assert all(nxt - end < step for end, nxt in zip(ends, [*offsets[1:], total]))  # padding < one step
    assert total >= ends[-1]


def test_padded_staging_holds_each_part_at_its_offset() -> None:
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.int64, torch.int32, torch.float32, torch.bool):
        parts = [torch.randint(0, 2, (n,), generator=g).to(dtype) for n in (5, 1, 0, 9, 3)]
        offsets, total = pack_layout([p.numel() for p in parts], dtype.itemsize)
        staging = torch.cat(_with_padding(parts, offsets, total, dtype))
        assert staging.numel() == total
        for p, off in zip(parts, offsets):
            assert torch.equal(staging[off : off + p.numel()], p)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("what", ["pack", "to_device", "forward_input", "req_to_token_write"])
def test_cuda_copies_do_not_wait_for_queued_work(what: str) -> None:
    """A pageable copy would synchronize the stream first; each of these must return while a long
    kernel is still queued (the stream is observed busy right after it returns)."""
    dev = torch.device("cuda")
    table = torch.zeros(4, 16, dtype=torch.int64, device=dev)
    index = torch.tensor([[1, 2], [0, 1], [3, 4]])

    def act() -> object:
        if what == "pack":
            return pack_to_device([torch.arange(6), torch.rand(3)], dev)
        if what == "to_device":
            return to_device(torch.tensor([3, 4]), dev)
        if what == "forward_input":
            return _fi().to(dev)
        (d,) = pack_to_device([index], dev)
        assert d is not None
        table[d[0], d[1]] = d[2]
        return d

    act()  # warm: the caching host allocator has pinned blocks to hand out
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued on the stream
    result = act()
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, f"{what}: a host-to-device copy waited for the queued kernel"
    if what == "pack":
        assert result[0].tolist() == list(range(6))  # type: ignore[index]
    elif what == "forward_input":
        assert result.input_ids.tolist() == [5, -3, 7]  # type: ignore[attr-defined]
    elif what == "req_to_token_write":
        assert table[1, 0].item() == 3 and table[2, 1].item() == 4


@pytest.mark.gpu
@needs_cuda
def test_sampling_builder_keeps_per_batch_columns_on_the_device() -> None:
    """Per-batch columns are copied once per batch composition; per-step parts stay on the host."""
    from phloem.runtime.sampling.batch import SamplingBatchBuilder
    from phloem.runtime.sampling.params import SamplingParams

    params = [SamplingParams(temperature=0.5, top_k=5), SamplingParams(min_new_tokens=3, logit_bias={4: 1.0})]
    host = SamplingBatchBuilder(64, eos_token_ids=[2]).build_from(params, output_ids=[[1], []])
    builder = SamplingBatchBuilder(64, eos_token_ids=[2], pin_memory=True, device=torch.device("cuda"))
    first = builder.build_from(params, output_ids=[[1], []])
    again = builder.build_from(params, output_ids=[[1, 5], [7]])
    for name in ("temperatures", "top_ps", "top_ks", "min_ps", "logit_bias"):
        dev = getattr(first, name)
        assert dev.is_cuda and torch.equal(dev.cpu(), getattr(host, name)), name
        assert getattr(again, name) is dev, name  # same batch: not copied again
    assert first.banned_mask is not None and not first.banned_mask.is_cuda
