"""Builds the ``ForwardInput`` of one step from the requests in it (host tensors only)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from phloem.runtime.forward_io import ForwardInput, ForwardMode, LogprobRequest, SamplingInfo
from phloem.runtime.host_copy import pack_to_device, to_device
from phloem.runtime.scheduler.req import Req

if TYPE_CHECKING:
    from phloem.runtime.scheduler.steps import StepKind


@dataclass
class ScheduledBatch:
    """One launched step: its requests and what each row means for result processing."""

    mode: ForwardMode
    reqs: list[Req]
    # The step kind that built the batch: it launches and processes it (see ``steps``).
    kind: StepKind | None = None
    # Rows whose sampled token is discarded (a prefill chunk that does not end the prompt,
    # or a prefill-only request).
    discard: list[bool] = field(default_factory=list)
    chunk: list[bool] = field(default_factory=list)  # rows that are a non-final prefill chunk
    # Rows computing prompt tokens (not decode rows of a mixed batch): their KV enters the tree
    # as soon as the step is processed, so siblings can share it while this request still runs.
    prefill_row: list[bool] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    # Rows that asked for input logprobs in this pass, with the absolute start position.
    input_logprob_from: list[int] = field(default_factory=list)
    future_ids: range | None = None  # FutureMap ids of the rows (see launch)
    # Speculative decode step: one SpecRow per request (already drafted), slots of all tree nodes.
    spec_rows: list[Any] | None = None
    spec_slots: torch.Tensor | None = None
    # Speculative window: greedy chain steps run on the device before the host reads them;
    # spec_slots then holds each row's window slots, row after row (positions kv_len ..).
    spec_window: int = 0
    # Plain decode step: [5, B] host tensor of each row's req_to_token row, its kv_len before the
    # step (the new token's position), the slot allocated for it, its seq_len and extend_len (1)
    # (write_decode_slots); saves gathering slots back out of the device-side req_to_token table.
    decode_index: torch.Tensor | None = None
    # Continuous decode: steps run back to back, and ``[steps, B]`` host slots of each step.
    decode_steps: int = 1
    step_slots: torch.Tensor | None = None

    @property
    def is_prefill(self) -> bool:
        return self.mode == ForwardMode.EXTEND


def build_forward_input(
    batch: ScheduledBatch,
    *,
    req_to_token: torch.Tensor,
    input_ids: Sequence[int],
    sampling: SamplingInfo,
) -> ForwardInput:
    """Flatten the batch. ``input_ids`` are the new tokens of every row in order (futures are
    negative); positions and output slots come from each request's ``kv_len`` before this step."""
    if batch.decode_index is not None:  # plain decode: one new token per row, slots known
        rows, prefix, out_slots, seq_lens, extend = batch.decode_index
        positions = prefix
    else:
        prefix = int64_tensor(batch.prefix_lens)
        extend = int64_tensor(batch.extend_lens)
        rows = int64_tensor([r.req_pool_idx for r in batch.reqs])
        seq_lens = prefix + extend
        host_index = extend_index(rows.numpy(), prefix.numpy(), extend.numpy())
        positions = torch.from_numpy(host_index[1].copy())
        index = to_device(torch.from_numpy(host_index), req_to_token.device)  # asynchronous
        out_slots = req_to_token[index[0], index[1]]
    logprobs = _logprob_request(batch)
    return ForwardInput(
        mode=batch.mode,
        input_ids=int64_tensor(input_ids),
        positions=positions,
        out_slots=out_slots,
        req_pool_indices=rows,
        seq_lens=seq_lens,
        prefix_lens=prefix,
        extend_lens=extend,
        sampling=sampling,
        logprobs=logprobs,
        decode_steps=batch.decode_steps,
        step_slots=batch.step_slots,
    )


def extend_index(rows: np.ndarray, prefix_lens: np.ndarray, extend_lens: np.ndarray) -> np.ndarray:
    """``[2, T]`` int64: the ``req_to_token`` row and the position of every new token of an extend
    batch, i.e. for each request ``r`` the pairs ``(rows[r], prefix_lens[r] + j)`` for
    ``j < extend_lens[r]``, request after request. Computed in numpy: Python lists cost a
    long prefill pass noticeable time on a CPU core that the forward worker's launches also need."""
    starts = np.cumsum(extend_lens) - extend_lens  # first token of each request in the batch
    out = np.empty((2, int(extend_lens.sum())), dtype=np.int64)
    out[0] = np.repeat(rows, extend_lens)
    out[1] = np.arange(out.shape[1], dtype=np.int64) - np.repeat(starts - prefix_lens, extend_lens)
    return out


def _logprob_request(batch: ScheduledBatch) -> LogprobRequest | None:
    if not any(r.return_logprob for r in batch.reqs):
        return None
    froms = batch.input_logprob_from or [-1] * len(batch.reqs)
    starts = [frm - prefix if frm >= 0 else -1 for frm, prefix in zip(froms, batch.prefix_lens)]
    return LogprobRequest(
        return_logprob=torch.tensor([r.return_logprob for r in batch.reqs], dtype=torch.bool),
        top_logprobs_nums=[r.top_logprobs_num if r.return_logprob else 0 for r in batch.reqs],
        token_ids_logprob=[r.token_ids_logprob if r.return_logprob else None for r in batch.reqs],
        input_logprob_starts=starts,
        processed=[r.return_logprob and r.params.logprob_mode == "processed" for r in batch.reqs],
    )


def gather_new_tokens(batch: ScheduledBatch) -> list[int]:
    """Input ids of every row: the slice of ``fill_ids`` being computed, except for a decode row
    whose last token is still in flight: its future id, ``-req.future_ref`` (see ``FutureMap``)."""
    ids: list[int] = []
    for r, start, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True):
        if r.pending_outputs:
            ids.append(-r.future_ref)
        else:
            ids.extend(r.fill_slice(start, start + n))
    return ids


def write_decode_slots(
    req_to_token: torch.Tensor,
    reqs: Sequence[Req],
    slots: torch.Tensor,
    steps: int = 1,
    *,
    kv_lens: Sequence[int] | None = None,
) -> torch.Tensor:
    """``req_to_token[row, kv_len + j] = slot`` for every decode row and each of ``steps`` steps,
    as one indexed write (a device table would otherwise take one small copy per row). ``slots``
    holds ``steps`` slots per row, row after row. Returns the host ``[5, B]`` index (rows,
    kv_lens, step 0's slots, kv_lens + 1, ones) for :attr:`ScheduledBatch.decode_index`: every
    per-row column of a decode ``ForwardInput`` in one tensor, filled in numpy (a torch op per
    column, or ``torch.tensor`` of a list, costs more than the whole fill at this size).
    ``kv_lens``: each row's first position, when not its ``kv_len`` (a jump's lead pass comes
    first, ``steps.lead``)."""
    n = len(reqs)
    index = np.empty((5, n), dtype=np.int64)
    index[0] = [r.req_pool_idx for r in reqs]
    index[1] = [r.kv_len for r in reqs] if kv_lens is None else kv_lens
    per_row = slots.numpy().reshape(n, steps)
    index[2] = per_row[:, 0]
    np.add(index[1], 1, out=index[3])
    index[4] = 1
    host = torch.from_numpy(index)
    if steps == 1:
        write = host[:3]
    else:  # (row, kv_len + j, slot j) for every row and step
        write = torch.from_numpy(np.stack([
            np.repeat(index[0], steps),
            (index[1][:, None] + np.arange(steps)).reshape(-1),
            per_row.reshape(-1),
        ]))  # fmt: skip
    (dev,) = pack_to_device([write], req_to_token.device)
    assert dev is not None
    rows, positions, new_slots = dev.unbind()
    req_to_token[rows, positions] = new_slots
    return host


def int64_tensor(values: Sequence[Any]) -> torch.Tensor:
    """A host int64 tensor from (nested lists of) Python ints. Numpy converts a list several
    times faster than ``torch.tensor``, which matters for lists of one entry per row each step."""
    return torch.from_numpy(np.array(values, dtype=np.int64))
