"""Build the host-side :class:`SamplingInfo` of one batch (runs every step, so keep it cheap).

Per-batch columns that depend only on the requests' :class:`SamplingParams` (temperatures, top-k,
penalty strengths, logit bias, seeds, ...) are built once and reused while the batch keeps the same
requests in the same order, which is the common case across consecutive decode steps. Per-step
parts are small: the step counters of seeded rows, the banned-token mask while a row is below
``min_new_tokens``, and the output ids of rows with penalties.

The returned tensors are shared with later steps and must be treated as read-only.

Overlap mode: a row's ``output_ids`` lacks the token still in flight, so its penalties lag by one
token; step counters and ``min_new_tokens`` use ``num_outputs_launched`` when the row has it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from phloem.runtime.forward_io import SamplingInfo
from phloem.runtime.host_copy import pack_to_device
from phloem.runtime.sampling.params import SamplingParams

_INT64_MAX = (1 << 63) - 1


class SamplingRow(Protocol):
    """What :meth:`SamplingBatchBuilder.build` reads from a request (the scheduler's ``Req``)."""

    params: SamplingParams
    output_ids: list[int]


@dataclass(frozen=True)
class _Static:
    """The per-batch part of a SamplingInfo, derived from the params alone."""

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    is_greedy_all: bool
    use_top_k_top_p: bool
    use_min_p: bool
    frequency: torch.Tensor | None
    presence: torch.Tensor | None
    repetition: torch.Tensor | None
    logit_bias: torch.Tensor | None
    penalized_rows: tuple[int, ...]
    banned_ids: tuple[tuple[int, ...], ...]  # per row: ids banned below min_new_tokens
    min_new_tokens: tuple[int, ...]
    min_new_rows: tuple[int, ...]  # rows with a min_new_tokens floor and ids to ban below it
    seeds: tuple[int | None, ...]  # params.sampling_seed per row
    seeded: bool  # any row has a seed


class SamplingBatchBuilder:
    """Builds :class:`SamplingInfo` for a batch, caching what does not change between steps.

    Parameters
    ----------
    vocab_size : int
        Width of the logits (``V``).
    eos_token_ids : iterable of int
        The model's end-of-sequence ids; banned, with ``stop_token_ids``, below ``min_new_tokens``.
    pin_memory : bool
        Allocate host tensors in pinned memory (for asynchronous copies to a GPU).
    device : torch.device, optional
        Where the per-batch columns live once built (the model's device). They are copied there
        once per batch composition instead of once per step; per-step parts stay on the host.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        eos_token_ids: Iterable[int] = (),
        pin_memory: bool = False,
        device: torch.device | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.pin_memory = pin_memory
        self.device = device
        self._key: tuple[int, ...] | None = None
        self._params: list[SamplingParams] = []  # keeps the ids in _key alive
        self._static: _Static | None = None
        self._penalty_buf: _OutputIdsBuffer | None = None

    def build(self, reqs: Sequence[SamplingRow], *, vocab_mask: torch.Tensor | None = None) -> SamplingInfo:
        """SamplingInfo for scheduler requests (``.params``, ``.output_ids``).

        The step of a row is ``req.num_outputs_launched`` when present (it counts tokens still in
        flight), else ``len(req.output_ids)``. Seeds come from ``params.sampling_seed``.
        """
        params = [r.params for r in reqs]
        static = self._static_for(params)
        # Only seeded rows, rows below min_new_tokens and penalized rows read steps or output ids:
        # a batch without them (the common case) skips both per-row lists.
        steps = None
        if static.seeded or static.min_new_rows:
            steps = [getattr(r, "num_outputs_launched", len(r.output_ids)) for r in reqs]
        output_ids = [r.output_ids for r in reqs] if static.penalized_rows else []
        seeds = static.seeds if static.seeded else None
        return self._assemble(static, output_ids=output_ids, seeds=seeds, steps=steps, vocab_mask=vocab_mask)

    def build_from(
        self,
        params: Sequence[SamplingParams],
        *,
        output_ids: Sequence[Sequence[int]],
        seeds: Sequence[int | None] | None = None,
        steps: Sequence[int] | None = None,
        vocab_mask: torch.Tensor | None = None,
    ) -> SamplingInfo:
        """SamplingInfo from explicit per-row values.

        Parameters
        ----------
        params : sequence of SamplingParams
            One per row.
        output_ids : sequence of sequence of int
            Tokens generated so far per row (for penalties).
        seeds : sequence of int or None, optional
            Per-row seed overriding ``params.sampling_seed`` (e.g. distinct seeds for ``n > 1``);
            ``None`` entries are unseeded. Omitted: taken from the params.
        steps : sequence of int, optional
            Tokens generated so far per row (position in the seeded stream, ``min_new_tokens``).
            Omitted: ``len(output_ids[i])``.
        vocab_mask : torch.Tensor, optional
            Grammar bitmask ``[B, ceil(V / 32)]`` int32, passed through.
        """
        static = self._static_for(params)
        if steps is None:
            steps = [len(ids) for ids in output_ids]
        if seeds is None:
            seeds = static.seeds if static.seeded else None
        return self._assemble(static, output_ids=output_ids, seeds=seeds, steps=steps, vocab_mask=vocab_mask)

    def _assemble(
        self,
        static: _Static,
        *,
        output_ids: Sequence[Sequence[int]],
        seeds: Sequence[int | None] | None,
        steps: Sequence[int] | None,
        vocab_mask: torch.Tensor | None,
    ) -> SamplingInfo:
        """The step's SamplingInfo. ``seeds`` None: no row is seeded. ``steps`` and ``output_ids``
        are read only for seeded rows, rows below min_new_tokens and penalized rows."""
        seed_t, step_t = self._seeds(seeds, steps) if seeds is not None else (None, None)
        return SamplingInfo(
            temperatures=static.temperatures,
            top_ps=static.top_ps,
            top_ks=static.top_ks,
            min_ps=static.min_ps,
            seeds=seed_t,
            steps=step_t,
            is_greedy_all=static.is_greedy_all,
            frequency_penalties=static.frequency,
            presence_penalties=static.presence,
            repetition_penalties=static.repetition,
            logit_bias=static.logit_bias,
            banned_mask=self._banned(static, steps),
            vocab_mask=vocab_mask,
            output_ids=self._penalty_ids(static, output_ids),
            use_top_k_top_p=static.use_top_k_top_p,
            use_min_p=static.use_min_p,
        )

    # ------------------------------------------------------------------ per batch (cached)
    def _static_for(self, params: Sequence[SamplingParams]) -> _Static:
        key = tuple(map(id, params))
        if key != self._key or self._static is None:
            self._static = self._on_device(self._build_static(params))
            self._key, self._params = key, list(params)
            rows = self._static.penalized_rows
            self._penalty_buf = _OutputIdsBuffer(len(params), rows, self.pin_memory) if rows else None
        return self._static

    def _on_device(self, static: _Static) -> _Static:
        if self.device is None or self.device.type == "cpu":
            return static
        names = (
            "temperatures",
            "top_ps",
            "top_ks",
            "min_ps",
            "frequency",
            "presence",
            "repetition",
            "logit_bias",
        )
        moved = pack_to_device([getattr(static, n) for n in names], self.device)
        return dataclasses.replace(static, **dict(zip(names, moved)))

    def _build_static(self, params: Sequence[SamplingParams]) -> _Static:
        sampled = [p for p in params if not p.is_greedy]
        penalized = tuple(i for i, p in enumerate(params) if p.has_penalties)
        eos = self.eos_token_ids
        banned_ids = tuple(_banned_ids(p, eos) for p in params)
        seeds = tuple(p.sampling_seed for p in params)
        return _Static(
            temperatures=self._f32([p.temperature for p in params]),
            top_ps=self._f32([p.top_p for p in params]),
            top_ks=self._i64([p.top_k for p in params]),
            min_ps=self._f32([p.min_p for p in params]),
            is_greedy_all=not sampled,
            use_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in sampled),
            use_min_p=any(p.min_p > 0.0 for p in sampled),
            frequency=self._f32([p.frequency_penalty for p in params]) if penalized else None,
            presence=self._f32([p.presence_penalty for p in params]) if penalized else None,
            repetition=self._f32([p.repetition_penalty for p in params]) if penalized else None,
            logit_bias=self._bias(params),
            penalized_rows=penalized,
            banned_ids=banned_ids,
            min_new_tokens=tuple(p.min_new_tokens for p in params),
            min_new_rows=tuple(i for i, p in enumerate(params) if p.min_new_tokens > 0 and banned_ids[i]),
            seeds=seeds,
            seeded=any(s is not None for s in seeds),
        )

    def _bias(self, params: Sequence[SamplingParams]) -> torch.Tensor | None:
        if not any(p.logit_bias for p in params):
            return None
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for i, p in enumerate(params):
            for tok, value in (p.logit_bias or {}).items():
                if tok < self.vocab_size:
                    rows.append(i)
                    cols.append(tok)
                    values.append(value)
        bias = torch.zeros(len(params), self.vocab_size, dtype=torch.float32, pin_memory=self.pin_memory)
        bias[torch.tensor(rows, dtype=torch.int64), torch.tensor(cols, dtype=torch.int64)] = torch.tensor(
            values
        )
        return bias

    # ------------------------------------------------------------------ per step
    def _seeds(
        self, seeds: Sequence[int | None], steps: Sequence[int] | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if all(s is None for s in seeds):
            return None, None
        assert steps is not None  # given whenever a row is seeded
        # Seeds map into [0, 2**63) so that -1 stays free to mean "unseeded".
        values = [-1 if s is None else s & _INT64_MAX for s in seeds]
        return self._i64(values), self._i64(list(steps))

    def _banned(self, static: _Static, steps: Sequence[int] | None) -> torch.Tensor | None:
        if not static.min_new_rows:
            return None
        assert steps is not None  # given whenever a row has a min_new_tokens floor
        rows: list[int] = []
        cols: list[int] = []
        for i in static.min_new_rows:
            if steps[i] < static.min_new_tokens[i]:
                in_vocab = [t for t in static.banned_ids[i] if t < self.vocab_size]
                rows += [i] * len(in_vocab)
                cols += in_vocab
        if not rows:
            return None
        mask = torch.zeros(
            len(static.banned_ids), self.vocab_size, dtype=torch.bool, pin_memory=self.pin_memory
        )
        mask[torch.tensor(rows), torch.tensor(cols)] = True
        return mask

    def _penalty_ids(self, static: _Static, output_ids: Sequence[Sequence[int]]) -> torch.Tensor | None:
        if self._penalty_buf is None:
            return None
        return self._penalty_buf.update(output_ids)

    # ------------------------------------------------------------------ helpers
    def _f32(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, pin_memory=self.pin_memory)

    def _i64(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, pin_memory=self.pin_memory)


class _OutputIdsBuffer:
    """Padded ``[B, L]`` int64 output ids of the penalized rows, kept across steps of one batch.

    Output lists only grow between steps, so each step writes just the new tokens of each row; a
    row whose list object changed or got shorter is rewritten. The buffer is numpy (cheap
    per-row writes, no thread pool); :meth:`update` returns a fresh tensor, so a previous step's
    tensor (perhaps still being copied to the device) is never written to.
    """

    def __init__(self, batch: int, rows: tuple[int, ...], pin_memory: bool) -> None:
        self.rows = rows
        self.pin_memory = pin_memory
        self.buf = np.full((batch, 64), -1, dtype=np.int64)
        self.filled = [0] * batch
        self.sources = [0] * batch  # id() of the list each row was filled from

    def update(self, output_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        width = 1
        for i in self.rows:
            ids = output_ids[i]
            n = len(ids)
            if id(ids) != self.sources[i] or n < self.filled[i]:
                self.buf[i] = -1
                self.filled[i], self.sources[i] = 0, id(ids)
            if n > self.buf.shape[1]:
                self._grow(n)
            if n > self.filled[i]:
                self.buf[i, self.filled[i] : n] = ids[self.filled[i] : n]
                self.filled[i] = n
            width = max(width, n)
        out = torch.from_numpy(self.buf[:, :width].copy())  # contiguous, never aliases the buffer
        return out.pin_memory() if self.pin_memory else out

    def _grow(self, n: int) -> None:
        cap = max(n, 2 * self.buf.shape[1])
        bigger = np.full((self.buf.shape[0], cap), -1, dtype=np.int64)
        bigger[:, : self.buf.shape[1]] = self.buf
        self.buf = bigger


def _banned_ids(p: SamplingParams, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """Tokens that would end the request, hence banned until ``min_new_tokens`` are out."""
    if p.min_new_tokens == 0:
        return ()
    ids = set(p.stop_token_ids or ())
    if not p.ignore_eos:
        ids.update(eos_token_ids)
    return tuple(sorted(ids))


def build_sampling_info(
    params: Sequence[SamplingParams],
    *,
    output_ids: Sequence[Sequence[int]],
    vocab_size: int,
    seeds: Sequence[int | None] | None = None,
    steps: Sequence[int] | None = None,
    eos_token_ids: Iterable[int] = (),
    vocab_mask: torch.Tensor | None = None,
) -> SamplingInfo:
    """One-off :class:`SamplingInfo` (no caching); see :meth:`SamplingBatchBuilder.build_from`."""
    builder = SamplingBatchBuilder(vocab_size, eos_token_ids=eos_token_ids)
    return builder.build_from(params, output_ids=output_ids, seeds=seeds, steps=steps, vocab_mask=vocab_mask)
