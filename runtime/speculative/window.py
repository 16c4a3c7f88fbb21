"""Several EAGLE chain steps on the device, read back once (docs/design.md §5, §7).

A host-driven speculative step waits on the GPU twice: to read the drafts, and to read what the
verify pass accepted before it can commit and catch the drafter up. At batch 1 on a fast GPU the
host's share of a step is larger than the GPU's. For a chain drafter (``topk == 1``), nothing in a
step needs the host once its state is on the device::

    state [7, B] int64:  req row | kv_len | newest token (root) | draft-cache row | draft length
                         | draft position offset | real row (1) or padding (0)
    step:  draft     D tokens from the root: the head over its own cache, one level per token
           verify    the target over [root, d1 .. dD] at positions kv_len .. kv_len + D, causal;
                     each position's slot is read from req_to_token
           accept    greedy rows: a = 1 + the drafts that equal the target's argmax before
                     the first miss; sampled rows: speculative sampling with device draws
                     (:func:`chain_accept_sampled`); record the D + 1 tokens and a
           catch-up  the head over the a accepted tokens, with the target's features
           advance   kv_len and draft length += a; root = the a-th token (the bonus token)

Why slots by position work: a chain's node at depth d sits at position kv_len + d, and what a
verify accepts is a prefix of the chain, so the accepted K/V is already where it belongs. The
committing is the length update; a rejected node's position is written again by the next step,
into the same slot. The scheduler gives each row ``K * (D + 1)`` fresh slots at positions
``kv_len ..`` before a window of ``K`` steps (no step can write past them) and frees those past the
final ``kv_len`` after it.

The step is one CUDA graph per (padded batch, acceptance mode: greedy, sampled, sampled with
top-k/top-p), replayed ``K`` times back to back (the draft's attention reads its key counts on the
device, :mod:`.draft_attention`; where its torch reference runs instead, graphs are also keyed by
the draft key width);
the host then reads ``[K, B, D + 1]`` tokens and ``[K, B]`` accept lengths in one copy. Tokens a
row produces after its stop are computed and dropped by the scheduler. Off CUDA the same step runs
eagerly (how the CPU tests pin it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from phloem.runtime.attention.cpu import decodes_in_rows
from phloem.runtime.cache.kv_pool import PADDING_SLOT
from phloem.runtime.executor.cuda_graph import capture_batch_sizes, capture_graphs
from phloem.runtime.executor.verify_graph import CpuChainAttention, TreeVerifyBackend
from phloem.runtime.layers.fusion import use_skinny
from phloem.runtime.sampling.sampler import GREEDY_EPS, gumbel_argmax, min_p_drop_mask, top_k_top_p_drop_mask
from phloem.runtime.speculative.draft_attention import draft_attend, uses_kernel
from phloem.runtime.speculative.draft_graph import RESERVED_DRAFT_LENGTH, SCRATCH_SEQ
from phloem.runtime.speculative.eagle import EagleDraftWorker
from phloem.runtime.speculative.verify import GREEDY, SpecSampling

__all__ = ["ChainWindow", "WindowResult", "WindowRow", "chain_accept", "chain_accept_sampled", "chain_probs"]

logger = logging.getLogger(__name__)

_MIN_WIDTH = 64
_FIELDS = 7  # rows of the state tensor (module docstring)


@dataclass
class WindowRow:
    """One request of a window (plain values from the scheduler's ``Req``)."""

    seq: int  # req_pool_idx: the target's req_to_token row and the drafter's key
    kv_len: int  # tokens with KV; ``root`` (the newest token) has none yet
    root: int
    sampling: SpecSampling = GREEDY


@dataclass
class WindowResult:
    """Per row, the tokens of each step (``accept`` of them, the bonus last)."""

    tokens: list[list[list[int]]]  # [row][step] -> that step's accepted tokens

    def total(self, row: int) -> int:
        return sum(len(t) for t in self.tokens[row])


def chain_accept(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance of chains: ``drafts`` ``[B, D]``, the target's argmax at every node
    ``[B, D + 1]`` -> tokens gained ``[B]``: 1 + the drafts before the first that differs from the
    target's choice at its parent."""
    return 1 + (drafts == target[:, :-1]).long().cumprod(dim=1).sum(dim=1)


def chain_probs(logits: torch.Tensor, params: torch.Tensor, *, filters: bool) -> torch.Tensor:
    """The distributions the plain sampler draws from, per row of ``logits`` ``[R, V]``, with each
    row's ``params`` ``[4, R]`` (temperature, top-k, top-p, min-p; a greedy row's temperature is
    taken as 1, its distribution is not used): temperature, then top-k/top-p (only when
    ``filters``: a sort of every row), then min-p, as :func:`~.verify.target_probs`."""
    temperature, top_k, top_p, min_p = params.unbind(0)
    x = logits.float() / torch.where(temperature < GREEDY_EPS, 1.0, temperature)[:, None]
    if filters:
        x = x.masked_fill(top_k_top_p_drop_mask(x, top_k.long(), top_p), float("-inf"))
    x = x.masked_fill(min_p_drop_mask(x, min_p), float("-inf"))
    return torch.softmax(x, dim=-1)


def chain_accept_sampled(
    drafts: torch.Tensor,
    logits: torch.Tensor,
    params: torch.Tensor,
    *,
    filters: bool,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling over chains: ``drafts`` ``[B, D]`` (drawn greedily: a point mass),
    the target's logits at every node ``[B, D + 1, V]``, each row's sampling ``params`` ``[4, B]``.
    Returns the emitted tokens ``[B, D + 1]`` (the first ``accept`` of them are real) and
    ``accept`` ``[B]``.

    Draft ``x`` at node ``j`` is accepted with probability ``p_j(x)`` (``min(1, p / q)`` with
    ``q = 1``); at the first rejection the emitted token is drawn from ``p_j`` without ``x``
    (the residual ``max(p - q, 0)``), after a fully accepted chain from the last node's ``p``. So
    every emitted token is distributed as the plain sampler's. Greedy rows (temperature 0 or
    top-k 1) take the argmax rule of :func:`chain_accept` instead. Draws use ``generator`` (None:
    the device's default, which CUDA graphs advance at every replay)."""
    b, n, vocab = logits.shape
    depth = n - 1
    temperature, top_k = params[0], params[1]
    greedy = (temperature < GREEDY_EPS) | (top_k == 1)
    probs = chain_probs(logits.reshape(b * n, vocab), params.repeat_interleave(n, dim=1), filters=filters)
    probs = probs.view(b, n, vocab)
    best = _argmax(logits.reshape(b * n, vocab)).view(b, n)
    p_draft = probs[:, :-1].gather(2, drafts[..., None])[..., 0]  # [B, D]
    u = torch.rand(p_draft.shape, generator=generator, device=logits.device)
    ok = torch.where(greedy[:, None], drafts == best[:, :-1], u < p_draft)
    accepted = ok.long().cumprod(dim=1).sum(dim=1)  # [B] drafts kept, 0 .. D
    at = accepted[:, None]
    p_last = probs.gather(1, at[..., None].expand(b, 1, vocab))[:, 0]  # [B, V]
    padded = torch.cat([drafts, drafts[:, -1:]], dim=1)  # [B, n]: the draft rejected at each node
    rejected = padded.gather(1, at)  # [B, 1]
    residual = torch.where((accepted < depth)[:, None], p_last.scatter(1, rejected, 0.0), p_last)
    noise = torch.rand(residual.shape, generator=generator, device=logits.device)
    drawn = gumbel_argmax(torch.log(residual), noise)  # a draw from the residual (unnormalized)
    last = torch.where(greedy, best.gather(1, at)[:, 0], drawn)
    return padded.scatter(1, at, last[:, None]), accepted + 1


class _Graph:
    """The step for one (padded batch, key width): its static state and outputs, and the graph."""

    def __init__(self, bs: int, steps: int, nodes: int, device: torch.device) -> None:
        self.state = torch.zeros((_FIELDS, bs), dtype=torch.int64, device=device)
        self.params = torch.zeros((4, bs), dtype=torch.float32, device=device)  # sampling, per row
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.tokens = torch.zeros((steps, bs, nodes), dtype=torch.int64, device=device)
        self.accept = torch.zeros((steps, bs), dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None


class ChainWindow:
    """EAGLE chain steps of up to ``max_bs`` rows, ``max_steps`` per window.

    Parameters
    ----------
    runner:
        The target model runner (its model, KV pool and req_to_token table).
    worker:
        The chain draft worker (``topk == 1``).
    capture:
        Capture CUDA graphs (on CUDA only); otherwise run the step eagerly.
    seed:
        Seed of the sampled rows' draws: a generator of the window's own off CUDA; on CUDA the
        device's default generator (the one CUDA graphs advance at every replay), seeded here.
    """

    def __init__(self, runner: Any, worker: EagleDraftWorker, *, max_bs: int, max_steps: int,
                 capture: bool = True, seed: int = 0) -> None:  # fmt: skip
        if worker.topk != 1:
            raise ValueError("a speculative window drafts chains: --speculative-eagle-topk must be 1")
        self.model = runner.model
        self.table = runner.req_to_token_pool.req_to_token
        self.worker = worker
        self.depth = worker.num_draft_tokens - 1  # D drafts per step
        self.nodes = self.depth + 1
        self.max_steps = max_steps
        self.device = worker.device
        self.batch_sizes = capture_batch_sizes(max(1, max_bs))
        self.capture = capture and self.device.type == "cuda"
        self.seed = seed
        self.generator: torch.Generator | None = None
        self.reset_generator()
        self.attn = (CpuChainAttention if decodes_in_rows(runner) else TreeVerifyBackend)(
            runner.kv_pool, runner.req_to_token_pool, num_heads=runner.model_config.num_heads
        )
        # room for the usual widths up front (see RESERVED_DRAFT_LENGTH)
        worker.cache.ensure(
            rows=self.batch_sizes[-1] + 1,
            length=max(_MIN_WIDTH, min(runner.context_len, RESERVED_DRAFT_LENGTH)),
        )
        (self.pad_row,) = worker.cache.reserve([SCRATCH_SEQ], [1])
        self.arange = torch.arange(self.nodes, device=self.device)
        chain = torch.ones(self.nodes, self.nodes, dtype=torch.int8, device=self.device).tril()
        self.chain_mask = chain.expand(self.batch_sizes[-1], -1, -1).contiguous()  # [max_bs, n, n]
        self.graphs: dict[tuple[int, int, str], _Graph] = {}  # (padded batch, key width, mode)
        self.pool: Any = None
        self._storage = self._storage_key()
        self.captured = 0
        self.capture_seconds = 0.0
        self.windows = 0  # windows run so far
        self.steps = 0  # speculative steps run inside them

    def reset_generator(self) -> None:
        """Start the sampled rows' draws over from ``seed`` (at construction; after the start-up
        warm-up, so a warmed-up engine draws what a fresh one draws)."""
        if self.device.type == "cuda":
            torch.cuda.manual_seed(self.seed)
        else:
            self.generator = torch.Generator(device=self.device).manual_seed(self.seed)

    # ---- host side ------------------------------------------------------------------------------
    def fits(self, num_rows: int) -> bool:
        return num_rows <= self.batch_sizes[-1]

    def slots_per_row(self, steps: int) -> int:
        """Fresh slots a row needs for a window of ``steps``, at positions ``kv_len ..``."""
        return steps * self.nodes

    @torch.inference_mode()
    def run(self, rows: Sequence[WindowRow], steps: int) -> WindowResult:
        """Run ``steps`` steps for ``rows``; ``req_to_token[seq, kv_len : kv_len +
        slots_per_row(steps)]`` must hold fresh slots. Advances the drafter's cache lengths."""
        if not 1 <= steps <= self.max_steps or not rows or not self.fits(len(rows)):
            raise ValueError(f"a window of {len(rows)} rows x {steps} steps is out of range")
        w = self.worker
        seqs = [r.seq for r in rows]
        w._ahead = None  # trees drafted ahead are stale once the window moves the cache
        bs = next(s for s in self.batch_sizes if s >= len(rows))
        lens = [w.cache.lens[s] for s in seqs]
        width = max(_MIN_WIDTH, 1 << (max(lens) + steps * self.nodes).bit_length())
        w.cache.ensure(rows=0, length=width)
        host = self._host_state(rows, seqs, lens, bs)
        params = self._host_params(rows, bs)
        mode = _mode(rows)
        g = self._graph(bs, width, mode, host, params)
        g.state.copy_(host, non_blocking=True)
        g.params.copy_(params, non_blocking=True)
        g.counter.zero_()
        for _ in range(steps):
            if g.graph is not None:
                g.graph.replay()
            else:
                self._step(g, width, mode)
        out = torch.cat([g.tokens[:steps].flatten(), g.accept[:steps].flatten()]).cpu().tolist()
        n = steps * bs * self.nodes
        tokens, accept = out[:n], out[n:]
        result: list[list[list[int]]] = []
        for b, seq in enumerate(seqs):
            per_step = []
            for k in range(steps):
                at = (k * bs + b) * self.nodes
                per_step.append(tokens[at : at + accept[k * bs + b]])
            result.append(per_step)
            w.cache.lens[seq] += sum(len(t) for t in per_step)
        self.windows += 1
        self.steps += steps
        return WindowResult(result)

    def _host_state(
        self, rows: Sequence[WindowRow], seqs: list[int], lens: list[int], bs: int
    ) -> torch.Tensor:
        w, pad = self.worker, bs - len(rows)
        cols = [
            [r.seq for r in rows] + [0] * pad,
            [r.kv_len for r in rows] + [0] * pad,
            [r.root for r in rows] + [0] * pad,
            [w.cache.row[s] for s in seqs] + [self.pad_row] * pad,
            lens + [1] * pad,
            [w.offset.get(s, 0) for s in seqs] + [0] * pad,
            [1] * len(rows) + [0] * pad,
        ]
        return self._host(cols, torch.int64)

    def _host_params(self, rows: Sequence[WindowRow], bs: int) -> torch.Tensor:
        pad = bs - len(rows)
        cols = [
            [r.sampling.temperature for r in rows] + [0.0] * pad,
            [float(r.sampling.top_k) for r in rows] + [-1.0] * pad,
            [r.sampling.top_p for r in rows] + [1.0] * pad,
            [r.sampling.min_p for r in rows] + [0.0] * pad,
        ]
        return self._host(cols, torch.float32)

    def _host(self, cols: list[list[Any]], dtype: torch.dtype) -> torch.Tensor:
        """``cols`` as a host tensor, pinned on CUDA (its copy to the graph's buffer is async)."""
        t = torch.tensor(cols, dtype=dtype)
        return t.pin_memory() if self.device.type == "cuda" else t

    def _storage_key(self) -> tuple[int, int, int]:
        c = self.worker.cache
        return c.k.data_ptr(), c.v.data_ptr(), c.features.data_ptr()

    def _graph(self, bs: int, width: int, mode: str, host: torch.Tensor, params: torch.Tensor) -> _Graph:
        if self._storage_key() != self._storage:  # the draft cache grew: graphs point at freed storage
            if self.capture:
                torch.cuda.synchronize(self.device)
            self.graphs.clear()
            self.pool = None
            self._storage = self._storage_key()
        # the attention kernel reads each query's key count on the device: one graph for every width
        key = (bs, 0 if uses_kernel(self.worker.cache.features) else width, mode)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = _Graph(bs, self.max_steps, self.nodes, self.device)
            if self.capture:
                self._capture(g, bs, width, mode, host, params)
        return g

    def _capture(
        self, g: _Graph, bs: int, width: int, mode: str, host: torch.Tensor, params: torch.Tensor
    ) -> None:
        """Capture the step on the window's real first state: the warm-up runs start from it
        (restored before each, so they write only where the window's first step writes, and the
        window's own first step writes the same values again)."""
        start = time.perf_counter()

        def run(_: int) -> None:
            if not torch.cuda.is_current_stream_capturing():
                g.state.copy_(host.to(self.device))
                g.params.copy_(params.to(self.device))
                g.counter.zero_()
            self._step(g, width, mode)

        graphs, _, self.pool = capture_graphs([bs], run, self.device, pool=self.pool)
        g.graph = graphs[bs]
        self.captured += 1
        self.capture_seconds += time.perf_counter() - start
        logger.info("captured the speculative window step (%s) for batch %d, key width %d in %.3f s",
                    mode, bs, width, time.perf_counter() - start)  # fmt: skip

    # ---- device side (a CUDA graph captures it) --------------------------------------------------
    def _step(self, g: _Graph, width: int, mode: str) -> None:
        rows, kv_len, root, drows, dlen, offset, real = g.state.unbind(0)
        bs, n = rows.shape[0], self.nodes
        drafts = self._draft_chain(drows, dlen, offset, width)  # [B, D]
        ids = torch.cat([root[:, None], drafts], dim=1)  # [B, n]
        positions = kv_len[:, None] + self.arange  # [B, n]
        slots = torch.where(real[:, None].bool(), self.table[rows[:, None], positions], PADDING_SLOT)
        self.attn.bind(rows, kv_len, slots.flatten(), self.chain_mask[:bs])
        hidden = self.model(ids.flatten(), positions.flatten(), self.attn)  # [B * n, H]
        logits = self.model.compute_logits(hidden)  # [B * n, V] float32
        if mode == "greedy":
            target = _argmax(logits).view(bs, n)
            accept = chain_accept(drafts, target)
        else:
            target, accept = chain_accept_sampled(
                drafts, logits.view(bs, n, -1), g.params, filters=mode == "filter", generator=self.generator
            )
        g.tokens.index_copy_(0, g.counter, target[None])
        g.accept.index_copy_(0, g.counter, accept[None])
        g.counter.add_(1)
        # catch-up: the head over the accepted tokens (queries past ``accept`` are padding: they
        # write draft K/V past the row's new length, which the next catch-up writes again)
        draft_pos = dlen[:, None] + self.arange
        self.worker._extend_core(target, offset[:, None] + draft_pos, draft_pos, drows, accept - 1,
                                 hidden.view(bs, n, -1), width)  # fmt: skip
        advance = accept * real
        kv_len.add_(advance)
        dlen.add_(advance)
        root.copy_(target.gather(1, (accept - 1)[:, None])[:, 0])

    def _draft_chain(
        self, drows: torch.Tensor, dlen: torch.Tensor, offset: torch.Tensor, width: int
    ) -> torch.Tensor:
        """``D`` greedy draft tokens per row (target vocabulary), the chain
        :meth:`EagleDraftWorker._grow_core` grows with ``topk == 1`` without its scores. Level
        ``l`` writes its K/V into the row's draft cache at entry ``dlen + l - 1``, past the
        committed ones, and sees entries ``0 .. dlen + l - 1``: the committed keys and its own
        path (:mod:`.draft_attention`). The step's catch-up writes those entries again with the
        accepted tokens' K/V (it writes ``D + 1`` entries from ``dlen``), so a rejected draft's
        K/V is never read as committed."""
        w, c = self.worker, self.worker.cache
        g = c.features[drows]  # [B, H]
        root_pos = offset + dlen - 1
        token = w.token_map[self._draft_argmax(g)]  # [B]
        out = [token]
        for level in range(1, self.depth):
            entry = (dlen + level - 1)[:, None]  # [B, 1]
            x, q, k, v = w.head.project(F.embedding(token[:, None], w.embed_weight), g[:, None],
                                        (root_pos + level)[:, None])  # fmt: skip
            c.k.index_put_((drows[:, None], entry), k)
            c.v.index_put_((drows[:, None], entry), v)
            attn = draft_attend(q, c.k, c.v, c.slots, drows, entry + 1, width + self.depth)
            g = w.head.finish(x, attn)[:, 0]  # [B, H]
            token = w.token_map[self._draft_argmax(g)]
            out.append(token)
        return torch.stack(out, dim=1)

    def _draft_argmax(self, g: torch.Tensor) -> torch.Tensor:
        """The best draft-vocabulary index after features ``g`` ``[B, H]``: the argmax of
        :meth:`EagleDraftWorker.draft_logits` (a 16-bit argmax equals that of its exact float32
        cast, so the copy to float32 is skipped on CUDA)."""
        w = self.worker
        if g.is_cuda:
            if use_skinny(g, w.lm_weight):  # one row: the skinny kernel, not the GEMM library's tiles
                from phloem.runtime.layers.skinny_gemm import skinny_linear

                return _argmax(skinny_linear(g, w.lm_weight))
            return _argmax(F.linear(g, w.lm_weight))
        return w.draft_logits(g).max(dim=-1).indices


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row argmax of ``[B, V]`` (lowest index on ties): the two-launch Triton kernel on CUDA (in a
    graph its launches cost the host nothing, and torch reduces a row in one thread block)."""
    if x.is_cuda:
        from phloem.runtime.sampling.argmax_triton import argmax_rows

        return argmax_rows(x)
    return x.argmax(dim=-1)


def _mode(rows: Sequence[WindowRow]) -> str:
    """``greedy`` (argmax acceptance only), ``sample`` (temperature and min-p) or ``filter`` (some
    row also uses top-k or top-p, which sorts every node's logits): one graph each."""
    sampled = [r.sampling for r in rows if not r.sampling.greedy]
    if not sampled:
        return "greedy"
    return "filter" if any(s.top_k > 0 or s.top_p < 1.0 for s in sampled) else "sample"
