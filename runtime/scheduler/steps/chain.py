"""Chain decode: continuous decode whose every step also takes each row's forced tokens, on the
device (``PHLOEM_JUMP_CHAIN``; the executor side is ``executor/chain_decode.py``).

Jump-forward on the host needs the host to see a row's state before its forced text is taken,
so each jump ends a launch and costs an extend pass of its own. Here a row that reaches a state
allowing one token takes it and those after it inside the step that reached it, so a launch
runs its steps whatever the rows' grammars force, and no jump waits for the host.

How many positions a row takes in a launch is known only when its tokens are read. So the
scheduler gives each row a block of slots for the most a launch may take (``K * W``), the device
writes those it takes into ``req_to_token`` and keeps the row's position, and processing adds the
positions taken to ``kv_len`` and frees the rest of the block. Until then ``kv_len`` lags
(``Req.chain_in_flight``): the next chain launch may start behind this one (the overlap loop's
steady state: its rows continue from the device's positions and states, their last tokens as
future ids), but any other kind of step first waits for every chain launch to be processed
(``Scheduler.schedule``), and so does admission.

Taken for a batch of at most ``jump_chain_rows`` rows when at least one row's grammar is on the
device and every row may decode ahead (``policy.decodes_ahead``); ``K`` is what continuous decode
would launch (one step while requests wait for admission: a chain step still takes its forced
tokens), cut so that every position fits the rows' context and the pool's free slots.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from phloem.runtime.forward_io import ForwardInput, ForwardMode
from phloem.runtime.scheduler.batch import ScheduledBatch, gather_new_tokens
from phloem.runtime.scheduler.policy import decodes_ahead
from phloem.runtime.scheduler.steps.continuous import ContinuousDecodeStep
from phloem.runtime.scheduler.steps.decode import decode_fields, live_rows

if TYPE_CHECKING:
    from phloem.runtime.scheduler.scheduler import Scheduler


class ChainDecodeStep:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self._continuous = ContinuousDecodeStep(scheduler)  # its step cap

    def schedule(self) -> ScheduledBatch | None:
        s = self.s
        width = s.cfg.jump_chain_width
        reqs = live_rows(s)
        if not reqs or len(reqs) > s.cfg.jump_chain_rows:
            return None
        if not any(r.automaton is not None for r in reqs) or not all(map(decodes_ahead, reqs)):
            return None
        steps = max(1, s.unseen_steps(reqs, self._continuous.step_cap()))
        # the most positions any row may have taken once its launches in flight are done
        reach = max(r.kv_len + r.pending_outputs * width for r in reqs)
        steps = min(steps, (s.req_pool.req_to_token.shape[1] - reach) // width)
        steps = min(steps, s.cache.available_size // (width * len(reqs)))
        if steps < 1:
            return None
        slots = s.cache.alloc(steps * width * len(reqs))
        if slots is None:
            return None
        for req in reqs:
            req.extend_len = 1
        batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=reqs, decode_steps=steps, kind=self)
        batch.step_slots = slots.view(len(reqs), steps * width)  # each row's block
        s.stats.continuous_decode_steps += steps
        s.stats.chain_launches += 1
        return decode_fields(s, batch, extend=1)

    def launch(self, batch: ScheduledBatch, vocab_mask: Any) -> Future[Any]:
        s = self.s
        reqs, steps = batch.reqs, batch.decode_steps
        future_ids = s.worker.future_map.reserve(len(reqs))
        sampling = s.sampling.build(reqs, vocab_mask=vocab_mask)
        assert s.grammar is not None
        auto = s.grammar.automaton_rows(reqs, batch.discard)
        assert auto is not None, "a chain launch has a row on the device"
        sampling.automaton, sampling.automaton_rows, sampling.automaton_init = auto
        n = len(reqs)
        # -1: the device knows where the row is (a chain launch of it is in flight)
        positions = torch.tensor([-1 if r.chain_in_flight else r.kv_len for r in reqs], dtype=torch.int64)
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        ones = torch.ones(n, dtype=torch.int64)
        fi = ForwardInput(
            mode=ForwardMode.DECODE, input_ids=torch.tensor(gather_new_tokens(batch), dtype=torch.int64),
            positions=positions, out_slots=batch.step_slots[:, 0].clone(), req_pool_indices=rows,
            seq_lens=positions + 1, prefix_lens=positions, extend_lens=ones, sampling=sampling,
            decode_steps=steps, chain_width=s.cfg.jump_chain_width, chain_slots=batch.step_slots,
        )  # fmt: skip
        batch.future_ids = future_ids
        for req, future in zip(reqs, future_ids):
            req.pending_outputs += steps
            req.chain_in_flight += 1
            req.future_ref = future
        return s.worker.submit(fi, future_ids)

    def process(self, batch: ScheduledBatch, fut: Future[Any]) -> None:
        """Each row's tokens, step after step (the forced ones, then the sampled one), appended
        at once; the positions taken join ``kv_len`` and the rest of each block is freed, before
        any request this step held back is released (its release frees what ``kv_len`` covers)."""
        s = self.s
        out = fut.result()
        out.synchronize()
        assert out.chain is not None
        # numpy views: per-row slicing there costs the loop below far less than torch indexing
        tokens, counts = out.chain[0].numpy(), out.chain[1].numpy()
        s.pace.decode_processed(out.step_time)  # a chain step is what the budget bounds here
        steps = batch.decode_steps
        used = counts.sum(axis=0).tolist()  # positions each row took
        assert batch.step_slots is not None
        blocks = batch.step_slots
        for r, req in enumerate(batch.reqs):
            req.pending_outputs -= steps
            req.chain_in_flight -= 1
            req.kv_len += used[r]
            s.cache.free_slots(blocks[r, used[r] :].clone())
        s.release_deferred()
        kept = forced = 0
        for r, req in enumerate(batch.reqs):
            if req.drop_stale(steps) or req.finished:
                continue
            row = tokens[:, r].ravel()  # step after step: its forced tokens, its sampled one, -1s
            # the budget left by the tokens seen so far (a later launch in flight continues these)
            new = row[row >= 0].tolist()[: req.params.max_new_tokens - len(req.output_ids)]
            if not new:
                continue
            before = len(req.output_ids)
            s.append_tokens(req, new, jump=False)
            kept += len(req.output_ids) - before
            forced += used[r] - steps
        s.stats.chain_forced_tokens += forced
        s.finish_decode(kept, steps=steps)
