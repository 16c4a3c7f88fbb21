"""The scheduler's collaborator for speculative decode steps (docs/design.md §4, §7).

The scheduler keeps its loop; with speculation on, a decode step becomes::

    rows = spec.plan(reqs)                     # drafts + slot needs, before any allocation
    slots = cache.alloc(sum(row.num_slots))    # one allocation for the whole step
    results = spec.verify(rows, slots)         # one target pass; req_to_token rows committed
    cache.free_slots(results[i].free_slots)    # rejected nodes' slots, at once
    req.kv_len += results[i].accept_length; output_ids += results[i].tokens; stop checks

This object owns the drafter (n-gram or EAGLE) and the verifier, knows nothing about ``Req``
beyond the plain values passed in, and never allocates KV itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from phloem.runtime.speculative.decoding import Drafter, EagleDrafter, NgramDrafter
from phloem.runtime.speculative.grammar import tree_bitmask
from phloem.runtime.speculative.tree import DraftTree
from phloem.runtime.speculative.verify import GREEDY, SpecSampling, TreeVerifier, VerifyRequest, VerifyResult

__all__ = ["SpecRow", "SpeculativeStep", "build_speculative_step"]

logger = logging.getLogger(__name__)


@dataclass
class SpecRow:
    """One request in a speculative step (plain values from the scheduler's ``Req``)."""

    req_pool_idx: int
    kv_len: int  # tokens with KV; the newest token (context[-1]) has none yet
    context: list[int]  # prompt + outputs so far (only the newest token when not needs_context)
    sampling: SpecSampling = GREEDY
    max_accept: int | None = None  # remaining max_new_tokens
    grammar: Any = None  # the request's GrammarMatcher (accepted up to context[-1]) or None
    tree: DraftTree | None = None  # filled by plan()

    @property
    def num_slots(self) -> int:
        assert self.tree is not None, "plan() first"
        return len(self.tree)


class SpeculativeStep:
    """Draft, verify and catch up for a batch of running requests.

    Parameters
    ----------
    runner:
        The target model runner.
    drafter:
        :class:`NgramDrafter` or :class:`EagleDrafter`.
    max_tree:
        Upper bound of one request's tree (slots to keep free per running request).
    """

    def __init__(
        self, runner: Any, drafter: Drafter, *, max_tree: int, seed: int = 0, max_batch: int = 0
    ) -> None:
        self.drafter = drafter
        self.verifier = TreeVerifier(runner, seed=seed, graphs=_verify_graphs(runner, max_tree, max_batch))
        self.vocab_size = runner.vocab_size
        self.max_tree = max_tree
        self.needs_hidden = isinstance(drafter, EagleDrafter)
        self.needs_context = not self.needs_hidden  # EAGLE drafts from its own cache and the newest token
        self.draft_ahead = True  # hint the drafter after each verify (off: benchmarks' A/B only)
        self.window: Any = None  # window.ChainWindow: several chain steps per host sync
        self.verify_count = 0
        self.accepted_tokens = 0
        self._prefill: dict[int, tuple[int, list[torch.Tensor]]] = {}  # row -> (start, hidden chunks)

    def reset_counters(self) -> None:
        """Forget what ran so far (after the start-up warm-up): acceptance counts, the samplers."""
        self.verify_count = self.accepted_tokens = 0
        self.verifier.reset_generator()
        if self.window is not None:
            self.window.reset_generator()

    @property
    def mean_accept_length(self) -> float:
        return self.accepted_tokens / self.verify_count if self.verify_count else 0.0

    # ---- prefill and plain steps (EAGLE needs the target's features of every computed token)
    def on_extend(self, row: int, start: int, hidden: torch.Tensor) -> None:
        """A prefill chunk of ``row`` computed positions ``start ..`` with features ``hidden``."""
        if not self.needs_hidden:
            return
        first, chunks = self._prefill.get(row, (start, []))
        chunks.append(hidden)
        self._prefill[row] = (first, chunks)

    def on_prefill_done(self, row: int, fill_ids: list[int], first_token: int) -> None:
        """The last chunk of ``row`` is done and sampled ``first_token``; ``fill_ids`` are the
        request's tokens before it (prompt, and outputs when re-admitted after retraction)."""
        start, chunks = self._prefill.pop(row, (0, []))
        if not self.needs_hidden:
            self.drafter.start(row, [*fill_ids, first_token], torch.empty(0))
            return
        hidden = torch.cat(chunks)
        tokens = [*fill_ids[start:], first_token]
        assert isinstance(self.drafter, EagleDrafter)
        self.drafter.worker.prefill(row, tokens, hidden, start=start)

    def on_plain_steps(
        self, rows: list[int], tokens: list[int], hidden_rows: list[torch.Tensor | None]
    ) -> None:
        """A plain decode step advanced each of ``rows`` by its token (``hidden_rows[i]``: the
        feature of the step's input token, ``[1, H]``); keeps the drafter in step, all rows in
        one catch-up pass."""
        if not self.needs_hidden or not rows:
            return
        results = []
        for token, hidden in zip(tokens, hidden_rows):
            assert hidden is not None, "plain decode steps must return hidden states with EAGLE"
            results.append(VerifyResult([token], [0], torch.empty(0, dtype=torch.int64), hidden))
        self.drafter.update_many(rows, results)

    @staticmethod
    def eligible(params: Any, *, wants_logprobs: bool, num_outputs: int) -> bool:
        """Whether a request may take speculative steps: the verify pass applies temperature,
        top-k, top-p, min-p and grammars (masks over the tree), but not penalties, logit bias,
        seeds, logprobs or the min_new_tokens ban (those requests take plain decode steps)."""
        return not (
            wants_logprobs
            or params.frequency_penalty
            or params.presence_penalty
            or params.repetition_penalty != 1.0
            or params.logit_bias
            or params.sampling_seed is not None
            or num_outputs < params.min_new_tokens
        )

    @staticmethod
    def sampling_of(params: Any) -> SpecSampling:
        return SpecSampling(params.temperature, params.top_k, params.top_p, params.min_p)

    def plan(self, rows: list[SpecRow]) -> int:
        """Draft a tree for every row; returns the slots the step needs in total."""
        trees = self.drafter.propose_many([r.req_pool_idx for r in rows], [r.context for r in rows])
        for r, tree in zip(rows, trees):
            r.tree = tree
        return sum(r.num_slots for r in rows)

    def verify(self, rows: list[SpecRow], slots: torch.Tensor) -> list[VerifyResult]:
        """One target pass over every row's tree, using ``slots`` (``plan``'s total, in row
        order); commits accepted nodes into ``req_to_token`` and catches the drafter up."""
        reqs, offset = [], 0
        for r in rows:
            assert r.tree is not None
            mask = None if r.grammar is None else tree_bitmask(r.tree, r.grammar, self.vocab_size)
            reqs.append(VerifyRequest(r.req_pool_idx, r.kv_len, r.tree, slots[offset : offset + r.num_slots],
                                      r.sampling, r.max_accept, mask))  # fmt: skip
            offset += r.num_slots
        results = self.verifier.verify(reqs)
        seqs = [r.req_pool_idx for r in rows]
        self.drafter.update_many(seqs, results)
        # the next step's trees, drafted on the GPU while the scheduler does its bookkeeping
        if self.draft_ahead:
            self.drafter.draft_ahead(seqs, [res.tokens[-1] for res in results])
        self.verify_count += len(results)
        self.accepted_tokens += sum(res.accept_length for res in results)
        return results

    def run_window(self, rows: list[Any], steps: int) -> Any:
        """``steps`` chain steps of ``rows`` (``window.WindowRow``) on the device, read back once
        (:class:`~phloem.runtime.speculative.window.ChainWindow`)."""
        assert self.window is not None
        result = self.window.run(rows, steps)
        self.verify_count += steps * len(rows)
        self.accepted_tokens += sum(result.total(i) for i in range(len(rows)))
        return result

    def release(self, row: int) -> None:
        self._prefill.pop(row, None)
        self.drafter.release(row)


def _verify_graphs(runner: Any, nodes: int, max_batch: int) -> Any:
    """On CUDA with Triton: padded verify passes, captured up to ``max_batch`` requests
    (``--disable-cuda-graph``: runner without decode graphs -> the same passes, eager)."""
    if runner.device.type != "cuda":
        return None
    from phloem.runtime.executor.verify_graph import VerifyGraphRunner

    graphs = VerifyGraphRunner(runner, nodes=nodes, max_bs=max_batch if runner.cuda_graphs is not None else 0)
    graphs.capture()
    return graphs


def build_speculative_step(
    runner: Any,
    algorithm: str,
    *,
    draft_model_path: str | None = None,
    num_steps: int = 3,
    topk: int = 1,
    num_draft_tokens: int = 4,
    seed: int = 0,
    max_batch: int = 0,
    window_steps: int = 1,
) -> SpeculativeStep:
    """From ``EngineArgs.speculative_*``: ``EAGLE`` (the shipped head by default) or ``NGRAM``;
    ``max_batch``: the most requests one verify pass holds (the verify graphs' largest size);
    ``window_steps > 1`` (``--num-continuous-decode-steps``): EAGLE chains run that many steps on
    the device per host sync."""
    name = algorithm.upper()
    if name == "NGRAM":
        from phloem.runtime.speculative.ngram import NgramProposer

        k = max(num_draft_tokens - 1, 1)
        return SpeculativeStep(
            runner, NgramDrafter(NgramProposer(k)), max_tree=k + 1, seed=seed, max_batch=max_batch
        )
    if name == "EAGLE":
        from phloem.runtime.speculative import DEFAULT_EAGLE_HEAD
        from phloem.runtime.speculative.draft_graph import RESERVED_DRAFT_LENGTH
        from phloem.runtime.speculative.eagle import EagleDraftWorker, load_eagle_head

        head = load_eagle_head(draft_model_path or DEFAULT_EAGLE_HEAD)
        worker = EagleDraftWorker.for_runner(head, runner, num_steps=num_steps, topk=topk,
                                             num_draft_tokens=num_draft_tokens)  # fmt: skip
        graphs = runner.device.type == "cuda" and runner.cuda_graphs is not None
        if graphs and max_batch > 0:
            # draft and catch-up as CUDA graphs, captured on first use
            worker.use_graphs(max_batch, reserve=min(runner.context_len, RESERVED_DRAFT_LENGTH))
        step = SpeculativeStep(
            runner, EagleDrafter(worker), max_tree=worker.num_draft_tokens, seed=seed, max_batch=max_batch
        )
        if window_steps > 1 and topk == 1 and worker.num_draft_tokens > 1:
            from phloem.runtime.speculative.window import ChainWindow

            step.window = ChainWindow(runner, worker, max_bs=max(1, max_batch), max_steps=window_steps,
                                      capture=graphs, seed=seed)  # fmt: skip
        elif window_steps > 1:
            logger.info("speculative windows draft chains (--speculative-eagle-topk 1); trees take one step per sync")
        return step
    raise ValueError(f"unknown speculative algorithm {algorithm!r}; expected EAGLE or NGRAM")
