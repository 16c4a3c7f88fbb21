"""Chain decode: continuous decode whose every step also takes each row's forced tokens, on the
device (``PHLOEM_JUMP_CHAIN``; the executor side is ``executor/chain_decode.py``).

Jump-forward on the host needs the host to see a row's state before its forced text is taken,
so each jump ends a launch and costs an extend pass of its own. Here a row that reaches a state
allowing one token takes it and those after it inside the step that reached it, so a launch
runs its steps whatever the rows' grammars force, and no jump waits for the host.

A launch of ``K`` steps reaches at most ``K * W`` positions a row: the scheduler gives each row
slots for all of them ahead (``req_to_token`` filled from its ``kv_len``), counts them into its
``kv_len`` at launch, and when the launch is processed frees the positions it did not reach.
How many that is is known only once the tokens are read, so a chain launch is processed at once
(the next launch needs each row's position); one behind a plain launch in flight reads that
launch's tokens as future ids, as any decode launch does.

Taken for a batch of at most ``jump_chain_rows`` rows when at least one row's grammar is on the
device and every row may decode ahead (``policy.decodes_ahead``); ``K`` is what continuous decode
would launch (one step while requests wait for admission: a chain step still takes its forced
tokens), cut so that every position fits the rows' context and the pool's free slots.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from phloem.runtime.forward_io import ForwardMode
from phloem.runtime.scheduler.batch import (
    ScheduledBatch,
    build_forward_input,
    gather_new_tokens,
    write_decode_slots,
)
from phloem.runtime.scheduler.policy import decodes_ahead
from phloem.runtime.scheduler.steps.continuous import ContinuousDecodeStep
from phloem.runtime.scheduler.steps.decode import decode_fields, live_rows

if TYPE_CHECKING:
    from phloem.runtime.scheduler.scheduler import Scheduler


class ChainDecodeStep:
    at_once = True  # processed right after its launch (Scheduler.step): see the module docstring

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
        room = s.req_pool.req_to_token.shape[1] - max(r.kv_len for r in reqs)
        steps = min(steps, room // width, s.cache.available_size // (width * len(reqs)))
        if steps < 1:
            return None
        per_row = steps * width
        slots = s.cache.alloc(per_row * len(reqs))
        if slots is None:
            return None
        index = write_decode_slots(s.req_pool.req_to_token, reqs, slots, per_row)
        for req in reqs:
            req.extend_len = 1
        batch = ScheduledBatch(
            mode=ForwardMode.DECODE, reqs=reqs, decode_index=index, decode_steps=steps, kind=self
        )
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
        fi = build_forward_input(
            batch, req_to_token=s.req_pool.req_to_token, input_ids=gather_new_tokens(batch), sampling=sampling
        )
        fi.chain_width = s.cfg.jump_chain_width
        batch.future_ids = future_ids
        for req, future in zip(reqs, future_ids):
            req.kv_len += steps * fi.chain_width  # every slot given ahead; process() gives back the rest
            req.pending_outputs += steps
            req.future_ref = future
        return s.worker.submit(fi, future_ids)

    def process(self, batch: ScheduledBatch, fut: Future[Any]) -> None:
        """Each row's tokens, step after step (the forced ones, then the sampled one), appended
        at once; the positions its launch did not reach are freed."""
        s = self.s
        out = fut.result()
        out.synchronize()
        assert out.chain is not None
        tokens, counts = out.chain
        s.pace.decode_processed(out.step_time)  # a chain step is what the budget bounds here
        s.release_deferred()
        steps = batch.decode_steps
        used = counts.sum(dim=0).tolist()  # positions each row reached
        table = s.req_pool.req_to_token
        kept = forced = 0
        for r, req in enumerate(batch.reqs):
            req.pending_outputs -= steps
            if req.req_pool_idx is not None:  # else released already, with every slot it held
                start = batch.prefix_lens[r]
                end = start + used[r]
                if req.kv_len > end:
                    s.cache.free_slots(table[req.req_pool_idx, end : req.kv_len].clone())
                    req.kv_len = end
            if req.drop_stale(steps) or req.finished:
                continue
            row = tokens[:, r]  # [K, W]: the forced tokens of a step, its sampled one, then -1
            new = row[row >= 0].tolist()[: req.remaining_new_tokens]
            if not new:
                continue
            before = len(req.output_ids)
            s.append_tokens(req, new, jump=False)
            kept += len(req.output_ids) - before
            forced += used[r] - steps
        s.stats.chain_forced_tokens += forced
        s.finish_decode(kept, steps=steps)
