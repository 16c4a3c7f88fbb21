"""Turn a batch of logits into next tokens (docs/design.md §5).

Order of operations for row ``b`` (every step is vectorized over the batch)::

    x = logits[b]
    x[t] = -inf            where the grammar bitmask disallows t (host mask, device automaton)
    x[t] = -inf            where t is banned (min_new_tokens not reached: EOS / stop ids)
    x += logit_bias[b]
    x = penalize(x, counts of tokens generated so far)
    greedy row  -> argmax(x)
    sampled row -> x /= temperature; drop tokens outside top-k, top-p, min-p;
                   argmax(x + gumbel noise)          (a draw from softmax(x))

Sampling uses the Gumbel-max trick: with ``g_t = -log(-log(u_t))`` and ``u_t`` uniform on (0, 1),
``argmax_t(x_t + g_t)`` is distributed as ``softmax(x)``. This needs no host sync (unlike
``torch.multinomial`` with per-row generators) and lets each row choose where its noise comes from:
a row with a seed hashes ``(seed, step, token)`` into ``u``, so its draw depends only on its own seed,
step and logits, never on the batch it runs in; other rows use the sampler's generator.

Nothing here reads tensor values on the host; branches depend only on Python fields of
:class:`SamplingInfo` (``is_greedy_all``, ``None`` checks, ``use_*`` hints).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from phloem.runtime.forward_io import SamplingInfo
from phloem.runtime.layers.fusion import use_fused

try:
    from phloem.grammars.bitmask import apply_bitmask as _apply_bitmask_inplace
except ImportError:  # pragma: no cover - the grammars package is optional at this layer
    _apply_bitmask_inplace = None

GREEDY_EPS = 1e-6
_M32 = 0xFFFFFFFF


class Sampler:
    """Samples one token per row; stateless apart from the generator for unseeded rows.

    Parameters
    ----------
    seed : int
        Seed of the generator used by rows without a ``sampling_seed``.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
        """Next token per row.

        Parameters
        ----------
        logits : torch.Tensor
            Float32 ``[B, V]``; not modified.
        info : SamplingInfo
            Per-row parameters, on the device of ``logits``.

        Returns
        -------
        torch.Tensor
            Int64 ``[B]`` token ids, on the device of ``logits``.
        """
        if info.automaton is not None and fused_automaton_greedy(info):
            return automaton_greedy_tokens(logits, info)
        return self._draw(logits, info, keep=False)[0]

    def sample_with_logits(
        self, logits: torch.Tensor, info: SamplingInfo
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token per row, and the logits each row's token was drawn from (``[B, V]``, with
        ``-inf`` where a token was excluded): ``softmax`` of row ``b`` is the distribution of
        ``tokens[b]``. A sampled row's logits went through :func:`process_logits`, temperature
        and the truncation filters; a greedy row's through :func:`process_logits` only (its token
        is that row's argmax). For the ``"processed"`` logprob mode."""
        tokens, x = self._draw(logits, info, keep=True)
        assert x is not None
        return tokens, x

    def _draw(
        self, logits: torch.Tensor, info: SamplingInfo, *, keep: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        auto = info.automaton
        states = auto.current(info.automaton_rows, info.automaton_init) if auto is not None else None
        x = process_logits(logits, info, automaton_states=states)
        drawn: torch.Tensor | None
        if info.is_greedy_all:
            tokens, drawn = greedy_tokens(x), x
        else:
            tokens, drawn = self._sample(x, info, keep=keep)
        if states is not None:
            auto.advance(info.automaton_rows, states, tokens)
        return tokens, drawn if keep else None

    def step_sampler(self, info: SamplingInfo) -> Callable[[torch.Tensor], torch.Tensor]:
        """``logits -> tokens`` for a batch that samples every one of several steps with ``info``
        (continuous decode's graph replays, where the host launches steps back to back and a
        launch costs it little): a batch of :func:`plain_greedy` rows takes the Triton argmax
        for every vocabulary (less GPU time than torch's one-block reduction), any other the
        sampler as called one step at a time."""
        if plain_greedy(info):
            return functools.partial(greedy_tokens, min_vocab=0)
        if info.automaton is not None and fused_automaton_greedy(info):
            return functools.partial(automaton_greedy_tokens, info=info)
        return functools.partial(self.__call__, info=info)

    def reset(self) -> None:
        """Restart the unseeded rows' generator from ``seed``, as if nothing had been sampled."""
        self._generators.clear()

    def generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def _sample(
        self, processed: torch.Tensor, info: SamplingInfo, *, keep: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens of a batch with sampled rows, and (``keep``) the logits each row's token came
        from: the sampled rows' scaled and truncated ``x``, the greedy rows' ``processed``."""
        is_greedy = (info.temperatures < GREEDY_EPS) | (info.top_ks == 1)  # [B]
        greedy = greedy_tokens(processed)
        temps = torch.where(is_greedy, torch.ones_like(info.temperatures), info.temperatures)
        x = processed / temps.unsqueeze(1)
        if info.use_top_k_top_p:
            x = x.masked_fill(top_k_top_p_drop_mask(x, info.top_ks, info.top_ps), float("-inf"))
        if info.use_min_p:
            x = x.masked_fill(min_p_drop_mask(x, info.min_ps), float("-inf"))
        u = torch.rand(x.shape, device=x.device, generator=self.generator(x.device))
        if info.seeds is not None:
            seeded = (info.seeds >= 0).unsqueeze(1)
            steps = info.steps if info.steps is not None else torch.zeros_like(info.seeds)
            u = torch.where(seeded, seeded_uniform(info.seeds, steps, x.shape[1]), u)
        sampled = gumbel_argmax(x, u)
        drawn = torch.where(is_greedy.unsqueeze(1), processed, x) if keep else None
        return torch.where(is_greedy, greedy, sampled), drawn


# Vocabularies from which greedy sampling on CUDA takes the Triton argmax. torch reduces a row in
# one thread block, which takes longer the larger the vocabulary. The Triton version takes less GPU
# time, but its two launches cost the host more than torch's one; a small model at batch 1 is
# host-bound, so the Triton version only pays where torch's reduction is long: large vocabularies.
TRITON_ARGMAX_MIN_VOCAB = 65536


def greedy_tokens(x: torch.Tensor, *, min_vocab: int = TRITON_ARGMAX_MIN_VOCAB) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of ``[B, V]`` logits: the two-launch Triton argmax on CUDA (the fused
    kernels' switch) for vocabularies of ``min_vocab`` and more, torch elsewhere. Both give the
    lowest index on ties."""
    if use_fused(x) and x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] >= min_vocab:
        from phloem.runtime.sampling.argmax_triton import argmax_rows

        return argmax_rows(x)
    return x.argmax(dim=-1)


def warm_up_kernels(vocab: int, device: torch.device) -> int:
    """Compile the Triton greedy kernels (:func:`greedy_tokens`, :func:`automaton_greedy_tokens`)
    for every batch size of ``vocab``-wide logits before serving: their launch plan changes with
    the batch, and a compile in the middle of a run stalls every running request. Returns the
    launches made (0 where the fused kernels are off)."""
    if not use_fused(torch.empty(0, device=device)):
        return 0
    from phloem.runtime.sampling import argmax_triton, automaton_triton

    return argmax_triton.warm_up(vocab, device) + automaton_triton.warm_up(vocab, device)


def plain_greedy(info: SamplingInfo) -> bool:
    """Whether every row's token is the argmax of its raw logits: all rows greedy and nothing of
    :func:`process_logits` applies (no mask, ban, bias or counted penalty)."""
    return (
        info.is_greedy_all
        and info.vocab_mask is None
        and info.automaton is None
        and info.banned_mask is None
        and info.logit_bias is None
        and info.output_token_counts is None
        and info.output_ids is None
    )


def fused_automaton_greedy(info: SamplingInfo) -> bool:
    """Whether a batch with device automata takes :func:`automaton_greedy_tokens`: every row greedy,
    no other logit processing, sampling tensors on CUDA with the fused kernels on."""
    rows = info.automaton_rows
    return (
        rows is not None
        and use_fused(rows)
        and info.is_greedy_all
        and info.vocab_mask is None
        and info.banned_mask is None
        and info.logit_bias is None
        and info.output_token_counts is None
        and info.output_ids is None
    )


def automaton_greedy_tokens(logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
    """Greedy tokens of a batch under device automata, whose states advance over them: the two
    Triton launches of :func:`~phloem.runtime.sampling.automaton_triton.automaton_greedy` (the
    torch path masks, takes the argmax and advances in about a dozen)."""
    from phloem.runtime.sampling.automaton_triton import automaton_greedy

    auto = info.automaton
    auto.start(info.automaton_rows, info.automaton_init)
    snap = auto.snapshot
    return automaton_greedy(logits, auto.table.state, info.automaton_rows, snap.masks, snap.keys, snap.targets)


# ---------------------------------------------------------------------- logit processing
def process_logits(
    logits: torch.Tensor, info: SamplingInfo, *, automaton_states: torch.Tensor | None = None
) -> torch.Tensor:
    """Apply grammar masks, banned tokens, logit bias and penalties (in this order).

    ``automaton_states``: the rows' states in ``info.automaton`` (grammars on the device), whose
    mask rows apply besides the host's ``vocab_mask``. Returns ``logits`` itself when nothing
    applies, otherwise a new tensor.
    """
    x = logits
    if info.vocab_mask is not None:
        x = apply_vocab_mask(x.clone(), info.vocab_mask)
    if automaton_states is not None:
        masks = info.automaton.snapshot.mask_rows(automaton_states)
        x = apply_vocab_mask(x.clone() if x is logits else x, masks)
    if info.banned_mask is not None:
        x = x.masked_fill(info.banned_mask, float("-inf"))
    if info.logit_bias is not None:
        x = x + info.logit_bias
    counts = _output_counts(info, x.shape[1])
    if counts is not None:
        x = apply_penalties(
            x,
            counts,
            frequency=info.frequency_penalties,
            presence=info.presence_penalties,
            repetition=info.repetition_penalties,
        )
        # a tiny repetition penalty can push a logit past float range: +inf would make softmax
        # NaN and let a masked token be drawn; the largest finite value keeps its rank instead
        x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))
    return x


def apply_vocab_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set logits the int32 grammar ``bitmask`` disallows to ``-inf``, in place; returns ``logits``.

    Bit ``j`` of word ``w`` of row ``b`` allows token ``32 * w + j``; columns past ``32 * words``
    are disallowed. Uses :func:`phloem.grammars.bitmask.apply_bitmask` when available.
    """
    if _apply_bitmask_inplace is not None:
        return _apply_bitmask_inplace(logits, bitmask)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1).flatten(1).bool()  # [B, 32*W]
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])], 1)
    return logits.masked_fill_(~allowed[:, :vocab], float("-inf"))


def _output_counts(info: SamplingInfo, vocab: int) -> torch.Tensor | None:
    if info.output_token_counts is not None:
        return info.output_token_counts
    if info.output_ids is not None:
        return token_counts(info.output_ids, vocab)
    return None


def token_counts(output_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Occurrences of each token per row: ``counts[b, t] = #{i : output_ids[b, i] == t}``.

    ``output_ids`` is int64 ``[B, L]`` padded with ``-1``; padding lands in an extra column that is
    dropped. Returns int32 ``[B, V]``.
    """
    idx = torch.where(output_ids < 0, torch.full_like(output_ids, vocab), output_ids)
    counts = torch.zeros(output_ids.shape[0], vocab + 1, dtype=torch.int32, device=output_ids.device)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.int32))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    *,
    frequency: torch.Tensor | None,
    presence: torch.Tensor | None,
    repetition: torch.Tensor | None,
) -> torch.Tensor:
    """Penalize tokens already generated; returns a new tensor.

    With ``c = counts[b, t]`` and ``seen = c > 0``::

        repetition r:  x = x / r if x > 0 else x * r        (only where seen)
        frequency  f:  x = x - f * c
        presence   p:  x = x - p * seen

    Each penalty tensor is float32 ``[B]``; ``None`` skips that penalty. Neutral values (r = 1,
    f = p = 0) leave a row unchanged.
    """
    seen = counts > 0
    x = logits
    if repetition is not None:
        r = repetition.unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if frequency is not None:
        x = x - frequency.unsqueeze(1) * counts.to(x.dtype)
    if presence is not None:
        x = x - presence.unsqueeze(1) * seen.to(x.dtype)
    return x


# ---------------------------------------------------------------------- truncation filters
def top_k_top_p_drop_mask(x: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Tokens outside the top-k, then outside the top-p nucleus of what is left. True = drop.

    Per row, with tokens sorted by ``x`` descending (ranks 0, 1, ...)::

        drop rank i   if i >= k                          (k <= 0 means off)
        q = softmax over the kept ranks (renormalized after top-k)
        drop rank i   if sum(q[0:i]) > p                 (rank 0 is always kept)

    ``top_ks`` int64 ``[B]``, ``top_ps`` float32 ``[B]``.
    """
    vocab = x.shape[1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=x.device)
    k = torch.where(top_ks <= 0, torch.full_like(top_ks, vocab), top_ks)
    drop = ranks.unsqueeze(0) >= k.unsqueeze(1)  # [B, V] in sorted order
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each rank
    p = torch.where(top_ps >= 1.0, torch.full_like(top_ps, float("inf")), top_ps)
    drop |= before > p.unsqueeze(1)
    return torch.zeros_like(drop).scatter_(1, order, drop)


def min_p_drop_mask(x: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Tokens whose probability is below ``min_p`` times the row's top probability. True = drop.

    ``softmax(x)[t] < min_p * max softmax(x)``  is equivalent to  ``x[t] < max(x) + log(min_p)``,
    so no softmax is needed; ``min_p = 0`` gives ``log 0 = -inf`` and drops nothing.
    """
    threshold = x.max(dim=-1, keepdim=True).values + torch.log(min_ps).unsqueeze(1)
    return x < threshold


# ---------------------------------------------------------------------- randomness
def gumbel_argmax(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from ``softmax(x)`` given uniforms ``u`` in [0, 1).

    ``argmax_t(x_t - log(-log u_t))`` (Gumbel-max). Tokens with ``x = -inf`` are never chosen;
    ``u = 0`` gives ``-inf`` noise, never NaN.
    """
    return (x - torch.log(-torch.log(u))).argmax(dim=-1)


def seeded_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Deterministic uniforms in (0, 1): ``u[b, t] = H(seeds[b], steps[b], t)``, float32 ``[B, V]``.

    ``H`` is a counter-based hash built from 32-bit mixing rounds, computed in int64 with every
    product kept below 2**63 (so no signed overflow on any device). The value depends only on
    ``(seed, step, t)``: a seeded row draws the same token for the same logits in any batch.
    The top 24 bits give ``u = (h + 0.5) / 2**24``.
    """
    seeds = seeds.to(torch.int64)
    steps = steps.to(torch.int64)
    key = _mix32((seeds & _M32) ^ _mix32(((seeds >> 32) & _M32) ^ 0x85EBCA6B))
    key = _mix32(key ^ _mix32((steps & _M32) ^ 0x27D4EB2F))  # [B]
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _mix32((tokens.unsqueeze(0) * 0x9E3779B1 + key.unsqueeze(1)) & _M32)  # [B, V]
    h = _mix32(h ^ key.unsqueeze(1))
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (xorshift-multiply rounds) on int64 values in [0, 2**32).

    The multipliers are odd and below 2**31, so each product stays below 2**63.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)
