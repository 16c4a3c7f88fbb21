"""Jump-forward inside a continuous decode launch: the launch's first pass extends the rows that
jumped (their forced tokens) and decodes every other row, and its remaining steps decode them
all on the device (``PHLOEM_JUMP_LEAD``).

Without it a jump costs the batch two host round trips: the decode launch is processed, the
rows that jumped extend their forced text in a pass of their own while the others wait, and only
once that pass is processed does the next decode launch start. Here the next launch starts from
the jumps at once. Every row of the lead pass is a chain of new tokens (one for a decoding row,
the forced run for a jumped one), which the short extend graphs replay (``extend_graphs.py``);
each row's last token is sampled, and the decode steps behind it read those tokens on the device.

Taken only where the prefill step would otherwise have extended the jumped rows alone: nothing
waits for admission, no prompt chunk is pending, every row decodes ahead (``unseen_steps``), no
launch of any row is in flight, and the pass fits a short extend graph
(``SchedulerConfig.jump_lead_tokens`` and ``jump_lead_rows``). Anything else leaves the jumped
rows to the prefill step.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from phloem.runtime.forward_io import ForwardMode
from phloem.runtime.host_copy import pack_to_device
from phloem.runtime.scheduler.batch import (
    ScheduledBatch,
    build_forward_input,
    extend_index,
    gather_new_tokens,
    write_decode_slots,
)
from phloem.runtime.scheduler.req import Req
from phloem.runtime.scheduler.steps.continuous import ContinuousDecodeStep
from phloem.runtime.scheduler.steps.decode import live_rows

if TYPE_CHECKING:
    from phloem.runtime.scheduler.scheduler import Scheduler


class JumpLeadStep:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self._continuous = ContinuousDecodeStep(scheduler)  # processes the launch's tokens

    def rows(self) -> tuple[list[Req], list[int]] | None:
        """The launch's rows, running ones first and then the jumped ones, with each row's new
        tokens in the lead pass; None when the jumped rows go to the prefill step."""
        s = self.s
        if not s.jumped or s.waiting or s.chunked is not None:
            return None
        if any(r.finished or r.stale_outputs for r in s.jumped):
            return None
        reqs = [*live_rows(s), *s.jumped]
        if len(reqs) > s.cfg.jump_lead_rows or any(r.pending_outputs for r in reqs):
            return None
        extend = [r.prompt_len + len(r.output_ids) - r.kv_len for r in reqs]  # fill_ids past the KV
        if max(extend) > s.cfg.jump_lead_tokens:
            return None
        return reqs, extend

    def schedule(self) -> ScheduledBatch | None:
        s = self.s
        found = self.rows()
        if found is None:
            return None
        reqs, extend = found
        steps = s.unseen_steps(reqs, self._continuous.step_cap(), jumped_ok=True)
        if steps < 1:
            return None
        need = sum(extend) + (steps - 1) * len(reqs)
        if s.cache.available_size < need:
            return None  # the prefill step retracts what it must
        slots = s.cache.alloc(need)
        if slots is None:
            return None
        s.running.extend(s.jumped)
        s.jumped = []
        batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=reqs, decode_steps=steps, kind=self)
        batch.prefix_lens = [r.kv_len for r in reqs]
        batch.extend_lens = extend
        n = len(reqs)
        batch.discard = [False] * n
        batch.chunk = [False] * n
        batch.prefill_row = [False] * n
        # the lead pass's slots, row after row (one indexed write), then each decode step's
        table = s.req_pool.req_to_token
        lead, rest = slots[: sum(extend)], slots[sum(extend) :]
        rows, where = extend_index(
            np.array([r.req_pool_idx for r in reqs]), np.array(batch.prefix_lens), np.array(extend)
        )
        (dev,) = pack_to_device([torch.from_numpy(np.stack([rows, where, lead.numpy()]))], table.device)
        assert dev is not None
        table[dev[0], dev[1]] = dev[2]
        if steps > 1:
            after = [r.kv_len + e for r, e in zip(reqs, extend)]
            batch.decode_index = write_decode_slots(table, reqs, rest, steps - 1, kv_lens=after)
            batch.step_slots = rest.view(n, steps - 1).T.contiguous()
        for req in reqs:
            req.extend_len = 1
        s.stats.continuous_decode_steps += steps
        s.stats.jump_lead_launches += 1
        s.count_decode_launch(steps)
        return batch

    def launch(self, batch: ScheduledBatch, vocab_mask: Any) -> Future[Any]:
        """The lead pass's ``ForwardInput`` (extend mode) carried by the decode steps' (decode
        mode, ``decode_steps - 1`` steps, from each row's position after its lead tokens)."""
        s = self.s
        reqs, steps = batch.reqs, batch.decode_steps
        future_ids = s.worker.future_map.reserve(len(reqs))
        sampling = s.sampling.build(reqs, vocab_mask=vocab_mask)
        auto = s.grammar.automaton_rows(reqs, batch.discard) if s.grammar is not None else None
        if auto is not None:  # every row starts from its matcher's state (nothing is in flight)
            sampling.automaton, sampling.automaton_rows, sampling.automaton_init = auto
        table = s.req_pool.req_to_token
        lead_batch = dataclasses.replace(
            batch, mode=ForwardMode.EXTEND, decode_index=None, decode_steps=1, step_slots=None
        )
        lead = build_forward_input(
            lead_batch, req_to_token=table, input_ids=gather_new_tokens(batch), sampling=sampling
        )
        tail = None
        if steps > 1:
            tail_batch = dataclasses.replace(batch, decode_steps=steps - 1)  # decode_index: after the lead
            # its ids are the lead pass's sampled tokens, on the device (placeholders here)
            tail = build_forward_input(
                tail_batch, req_to_token=table, input_ids=[0] * len(reqs), sampling=sampling
            )
        lead.then = tail
        batch.future_ids = future_ids
        for req, e, future in zip(reqs, batch.extend_lens, future_ids):
            req.kv_len += e + steps - 1
            req.pending_outputs += steps
            req.future_ref = future  # the last step's token
        return s.worker.submit(lead, future_ids)

    def process(self, batch: ScheduledBatch, fut: Future[Any]) -> None:
        self._continuous.process(batch, fut)  # the decode pace times the steps after the lead pass
