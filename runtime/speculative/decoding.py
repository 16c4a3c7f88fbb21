"""Speculative generation straight on a ``ModelRunner`` (tests, benchmarks, training reports).

The scheduler runs the same cycle inside its decode step; this driver keeps it on one screen::

    prefill(prompts)                 target extend pass -> first token + features of the prompt
    drafter.start(...)               EAGLE: draft prefill; n-gram: nothing
    while any sequence runs:
        trees  = drafter.propose_many(...)          one DraftTree per sequence, drafted together
        slots  = alloc(len(tree)) per sequence
        result = verifier.verify(...)               one target pass for the whole batch
        free(result.free_slots); kv_len += accept_length; append tokens; stop checks
        drafter.update_many(seqs, results)          EAGLE: one catch-up pass on the accepted tokens

Slots come from a private :class:`~phloem.runtime.cache.allocator.TokenSlotAllocator` over the
runner's KV pool; everything a sequence holds is returned when it ends.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from phloem.runtime.cache.allocator import TokenSlotAllocator
from phloem.runtime.executor.model_runner import greedy_sampling_info
from phloem.runtime.forward_io import ForwardInput, ForwardMode
from phloem.runtime.speculative.eagle import EagleDraftWorker
from phloem.runtime.speculative.ngram import NgramProposer
from phloem.runtime.speculative.tree import DraftTree
from phloem.runtime.speculative.verify import (
    GREEDY,
    SpecSampling,
    TreeVerifier,
    VerifyRequest,
    VerifyResult,
    target_probs,
)

__all__ = [
    "Drafter",
    "EagleDrafter",
    "NgramDrafter",
    "SpecOutput",
    "SpeculativeDecoder",
    "target_forward",
    "target_prefill",
]


class Drafter(Protocol):
    """What the decode cycle needs from a proposer."""

    def start(self, seq: int, tokens: list[int], hidden: torch.Tensor) -> None:
        """``tokens`` = prompt + first token; ``hidden`` = the target's features of the prompt."""

    def propose(self, seq: int, context: list[int]) -> DraftTree:
        """A tree rooted at ``context[-1]``."""

    def propose_many(self, seqs: list[int], contexts: list[list[int]]) -> list[DraftTree]:
        """:meth:`propose` for every sequence of a step (distinct ``seqs``), in their order."""

    def update(self, seq: int, result: VerifyResult) -> None:
        """Called after each verify (or plain decode step) with that sequence's result."""

    def update_many(self, seqs: list[int], results: list[VerifyResult]) -> None:
        """:meth:`update` for every sequence of a step (distinct ``seqs``)."""

    def draft_ahead(self, seqs: list[int], roots: list[int]) -> None:
        """A hint after a verify: the next :meth:`propose_many` will likely ask for these
        sequences with these newest tokens (a drafter may start on them now)."""

    def release(self, seq: int) -> None: ...


class NgramDrafter:
    """:class:`NgramProposer` as a :class:`Drafter` (stateless between steps)."""

    def __init__(self, proposer: NgramProposer) -> None:
        self.proposer = proposer

    def start(self, seq: int, tokens: list[int], hidden: torch.Tensor) -> None:
        pass

    def propose(self, seq: int, context: list[int]) -> DraftTree:
        return self.proposer.propose_tree(context)

    def propose_many(self, seqs: list[int], contexts: list[list[int]]) -> list[DraftTree]:
        return [self.proposer.propose_tree(c) for c in contexts]

    def update(self, seq: int, result: VerifyResult) -> None:
        pass

    def update_many(self, seqs: list[int], results: list[VerifyResult]) -> None:
        pass

    def draft_ahead(self, seqs: list[int], roots: list[int]) -> None:
        pass

    def release(self, seq: int) -> None:
        pass


class EagleDrafter:
    """:class:`EagleDraftWorker` as a :class:`Drafter`."""

    def __init__(self, worker: EagleDraftWorker) -> None:
        self.worker = worker

    def start(self, seq: int, tokens: list[int], hidden: torch.Tensor) -> None:
        self.worker.prefill(seq, tokens, hidden)

    def propose(self, seq: int, context: list[int]) -> DraftTree:
        return self.worker.draft_many([seq], [context[-1]])[0]

    def propose_many(self, seqs: list[int], contexts: list[list[int]]) -> list[DraftTree]:
        return self.worker.draft_many(seqs, [c[-1] for c in contexts])

    def update(self, seq: int, result: VerifyResult) -> None:
        self.worker.extend(seq, result.tokens, result.hidden)

    def update_many(self, seqs: list[int], results: list[VerifyResult]) -> None:
        self.worker.extend_many(seqs, [r.tokens for r in results], [r.hidden for r in results])

    def draft_ahead(self, seqs: list[int], roots: list[int]) -> None:
        self.worker.draft_ahead(seqs, roots)

    def release(self, seq: int) -> None:
        self.worker.release(seq)


@dataclass
class SpecOutput:
    """One sequence's generation: output tokens and the accept length of every verify."""

    tokens: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    decode_seconds: float = 0.0  # wall time after the prefill (drafting + verifying + catch-up)
    draft_seconds: float = 0.0  # of which proposing trees and catch-up (batch-wide)
    verify_seconds: float = 0.0  # of which target verify passes (batch-wide)

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


@torch.inference_mode()
def target_forward(
    runner: Any,
    rows: Sequence[int],
    new_tokens: Sequence[Sequence[int]],
    slots: Sequence[torch.Tensor],
    prefix_lens: Sequence[int] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A plain extend (or, with one token each, decode) pass through the runner's own attention
    backend: last-position logits ``[B, V]`` and each request's final hidden states ``[n, H]``.

    Writes ``slots`` into ``req_to_token[row, prefix : prefix + n]`` first.
    """
    table = runner.req_to_token_pool.req_to_token
    prefix = torch.tensor(list(prefix_lens) if prefix_lens is not None else [0] * len(rows))
    for row, p, s in zip(rows, prefix.tolist(), slots):
        table[row, p : p + s.numel()] = s.to(table.device)
    lens = torch.tensor([len(t) for t in new_tokens])
    decode = bool((lens == 1).all()) and prefix_lens is not None
    fi = ForwardInput(
        mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        input_ids=torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix.tolist(), lens.tolist())]),
        out_slots=torch.cat(list(slots)),
        req_pool_indices=torch.tensor(list(rows), dtype=torch.int64),
        seq_lens=prefix + lens,
        prefix_lens=prefix,
        extend_lens=lens,
        sampling=greedy_sampling_info(len(rows)),
    )
    if runner.device.type != "cpu":
        fi = fi.to(runner.device)
    runner.attn_backend.init_metadata(fi)
    hidden = runner.model(fi.input_ids, fi.positions, runner.attn_backend)  # [T, H]
    per_seq = list(hidden.split(lens.tolist()))
    last = torch.stack([h[-1] for h in per_seq])
    return runner.model.compute_logits(last), per_seq


def target_prefill(
    runner: Any, rows: Sequence[int], prompts: Sequence[Sequence[int]], slots: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Extend pass over whole prompts (see :func:`target_forward`)."""
    return target_forward(runner, rows, prompts, slots)


class SpeculativeDecoder:
    """Batched speculative generation over a runner with any :class:`Drafter`.

    Parameters
    ----------
    runner:
        Target :class:`~phloem.runtime.executor.model_runner.ModelRunner`.
    drafter:
        :class:`NgramDrafter` or :class:`EagleDrafter`.
    seed:
        Seed of the sampling generator.
    """

    def __init__(self, runner: Any, drafter: Drafter, *, seed: int = 0) -> None:
        self.runner = runner
        self.drafter = drafter
        self.verifier = TreeVerifier(runner, seed=seed)
        self.allocator = TokenSlotAllocator(runner.kv_pool.num_slots)

    def _first_token(self, logits: torch.Tensor, sampling: SpecSampling) -> list[int]:
        if sampling.greedy:
            return logits.argmax(dim=-1).tolist()
        probs = target_probs(logits, sampling).cpu()
        return torch.multinomial(probs, 1, generator=self.verifier.generator)[:, 0].tolist()

    def _alloc(self, n: int) -> torch.Tensor:
        slots = self.allocator.alloc(n)
        if slots is None:
            raise RuntimeError("KV pool exhausted")
        return slots

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        sampling: SpecSampling = GREEDY,
        stop_ids: frozenset[int] | set[int] = frozenset(),
    ) -> list[SpecOutput]:
        """Generate for every prompt (together); stops at ``max_new_tokens`` or a stop id (kept)."""
        pool = self.runner.req_to_token_pool
        rows = [pool.alloc() for _ in prompts]
        if any(r is None for r in rows):
            raise RuntimeError("no free req_to_token rows")
        outs = [SpecOutput() for _ in prompts]
        kv_lens = [len(p) for p in prompts]
        try:
            logits, hidden = target_prefill(
                self.runner, rows, prompts, [self._alloc(len(p)) for p in prompts]
            )
            first = self._first_token(logits, sampling)
            active = []
            for i, (p, t) in enumerate(zip(prompts, first)):
                outs[i].tokens.append(t)
                if t not in stop_ids and max_new_tokens > 1:
                    self.drafter.start(rows[i], [*p, t], hidden[i])
                    active.append(i)
            t0 = time.perf_counter()
            while active:
                active = self._cycle(active, rows, prompts, outs, kv_lens, max_new_tokens, sampling, stop_ids)
            for o in outs:
                o.decode_seconds = time.perf_counter() - t0
        finally:
            table = pool.req_to_token
            for i, row in enumerate(rows):
                self.allocator.free(table[row, : kv_lens[i]].clone())
                self.drafter.release(row)
                pool.free(row)
        return outs

    def _cycle(self, active, rows, prompts, outs, kv_lens, max_new, sampling, stop_ids) -> list[int]:  # noqa: ANN001
        t0 = time.perf_counter()
        trees = self.drafter.propose_many(
            [rows[i] for i in active], [[*prompts[i], *outs[i].tokens] for i in active]
        )
        reqs = []
        for i, tree in zip(active, trees):
            left = max_new - len(outs[i].tokens)
            reqs.append(
                VerifyRequest(rows[i], kv_lens[i], tree, self._alloc(len(tree)), sampling, max_accept=left)
            )
        t1 = time.perf_counter()
        results = self.verifier.verify(reqs)
        t2 = time.perf_counter()
        still, caught_up = [], []
        for i, res in zip(active, results):
            self.allocator.free(res.free_slots)
            kv_lens[i] += res.accept_length
            outs[i].accept_lengths.append(res.accept_length)
            new = res.tokens
            hit = next((j for j, t in enumerate(new) if t in stop_ids), None)
            outs[i].tokens.extend(new if hit is None else new[: hit + 1])
            if hit is None and len(outs[i].tokens) < max_new:
                still.append(i)
                caught_up.append(res)
        self.drafter.update_many([rows[i] for i in still], caught_up)  # EAGLE catch-up: counted as drafting
        self.drafter.draft_ahead([rows[i] for i in still], [outs[i].tokens[-1] for i in still])
        t3 = time.perf_counter()
        for i in active:
            outs[i].draft_seconds += (t1 - t0) + (t3 - t2)
            outs[i].verify_seconds += t2 - t1
        return still
