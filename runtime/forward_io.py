"""The two types that cross from the scheduler to the executor (docs/design.md §5).

The scheduler builds a :class:`ForwardInput` from host tensors only (it never creates device
tensors); the model runner moves it to the device with one copy and returns a
:class:`ForwardOutput`. Nothing else crosses this boundary.

Layout of one batch of ``B`` requests with ``T`` new tokens in total::

    request r:  prefix_lens[r] cached tokens | extend_lens[r] new tokens
    flat token axis (T = sum(extend_lens)):  [ r0 new tokens | r1 new tokens | ... ]
    seq_lens[r] = prefix_lens[r] + extend_lens[r]
    req_to_token[req_pool_indices[r], 0:seq_lens[r]] -> KV slots of request r
    out_slots[t] = req_to_token[req, positions[t]]   (where token t's K/V is written)

A decode batch is the special case ``extend_lens == 1``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill / chunked prefill / mixed (decode rows have extend_len 1)
    DECODE = 2  # one new token per request
    IDLE = 3  # nothing to run (kept for symmetry with multi-rank setups)
    TARGET_VERIFY = 4  # draft trees: extend_lens[r] nodes, each attending its prefix + ancestors


@dataclass
class SamplingInfo:
    """Per-row sampling tensors, host side, shape ``[B]`` unless noted.

    ``is_greedy_all`` lets the sampler take the argmax fast path without inspecting tensors.
    Penalties and logit bias are optional; ``None`` means no request in the batch uses them.
    """

    temperatures: torch.Tensor  # [B] float32; 0 means greedy
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64; -1 / vocab means off
    min_ps: torch.Tensor  # [B] float32
    seeds: torch.Tensor | None = None  # [B] int64; -1 = unseeded
    steps: torch.Tensor | None = None  # [B] int64 tokens generated so far (seeded RNG stream position)
    is_greedy_all: bool = False
    # Penalties over tokens generated so far ([B, V] counts built from output ids), or None.
    frequency_penalties: torch.Tensor | None = None  # [B]
    presence_penalties: torch.Tensor | None = None  # [B]
    repetition_penalties: torch.Tensor | None = None  # [B]
    output_token_counts: torch.Tensor | None = None  # [B, V] int32
    logit_bias: torch.Tensor | None = None  # [B, V] float32
    # Tokens that may not be sampled yet (min_new_tokens not reached): [B, V] bool or None.
    banned_mask: torch.Tensor | None = None
    # Grammar bitmask, int32 [B, ceil(V/32)]: bit j of word w allows token 32*w + j. None = free.
    vocab_mask: torch.Tensor | None = None
    # Grammars on the device (grammars.automaton.AutomatonLaunch), or None; with each row's
    # request-pool row and starting state (-1: continue from the device), [B] int64.
    automaton: Any = None
    automaton_rows: torch.Tensor | None = None
    automaton_init: torch.Tensor | None = None
    # Early exit of continuous decode (executor/decode_exit.py), or None: per row, the token ids
    # whose sampling certainly ends the request ([B, K] int64, -1 pads) and its stop tag ([B]).
    stop_ids: torch.Tensor | None = None
    stop_tags: torch.Tensor | None = None
    # Compact alternative to output_token_counts: [B, L] int64 output ids so far, padded with -1;
    # the sampler counts them on the device (a much smaller copy than [B, V]).
    output_ids: torch.Tensor | None = None
    # Host-side hints (no tensor inspection needed): False lets the sampler skip the sort for
    # top-k/top-p, or the min-p filter, because no row in the batch uses them.
    use_top_k_top_p: bool = True
    use_min_p: bool = True


@dataclass
class LogprobRequest:
    """What a request wants back beyond its sampled token (None on ForwardInput = nothing)."""

    return_logprob: torch.Tensor  # [B] bool: output logprob of the sampled token
    top_logprobs_nums: list[int]  # per request, 0 = none
    token_ids_logprob: list[list[int] | None]  # per request
    # Input logprobs: for request r, logprobs of its new tokens at extend offsets
    # >= input_logprob_starts[r] (-1 = none). Offsets are within this pass's new tokens.
    input_logprob_starts: list[int] = field(default_factory=list)
    # Per request: output logprobs from the distribution the token was drawn from (sampling
    # params' logprob_mode "processed") instead of the raw logits; missing entries mean raw.
    processed: list[bool] = field(default_factory=list)


@dataclass
class ForwardInput:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64, KV slot written by each new token
    req_pool_indices: torch.Tensor  # [B] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [B] int64
    prefix_lens: torch.Tensor  # [B] int64
    extend_lens: torch.Tensor  # [B] int64
    sampling: SamplingInfo
    logprobs: LogprobRequest | None = None
    # TARGET_VERIFY: per request, the parent of each node (-1 for the root; parents precede children)
    tree_parents: list[list[int]] | None = None
    # Return the final hidden states of every new token (EAGLE drafting after plain passes).
    return_hidden_states: bool = False
    # Rows whose sampled token is thrown away (a chunked prefill that is not finished yet).
    # They are still sampled so shapes stay static; the scheduler ignores their token.
    # Continuous decode (``--num-continuous-decode-steps``): a DECODE batch that runs this many
    # steps back to back, each feeding its sampled tokens to the next on the device. The fields
    # above describe step 0; ``step_slots[j]`` ([steps, B], host) are the slots step j writes.
    decode_steps: int = 1
    step_slots: torch.Tensor | None = None
    # A jump-forward lead pass (EXTEND, ``scheduler.steps.lead``): the continuous decode steps run
    # right after it, reading its sampled tokens on the device (their ``input_ids`` are ignored).
    then: ForwardInput | None = None
    # A chain decode launch (``executor/chain_decode.py``): a DECODE batch of ``decode_steps`` steps
    # whose every step is a chain pass of this many nodes a row (its forced tokens taken on the
    # device); ``positions`` is each row's position, or -1 where the device knows it, and
    # ``chain_slots`` ([B, decode_steps * chain_width], host) the slots each row may take.
    chain_width: int = 0
    chain_slots: torch.Tensor | None = None
    # EXTEND: (query-key pairs over cached prefixes, pairs among the new tokens), counted from
    # the host's lengths when the batch moves to the device (``to``), where they can no longer be
    # read without waiting for the stream. The Triton backend picks its key tiles from them.
    key_pairs: tuple[int, int] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def with_sampling_on(self, device: torch.device | str) -> ForwardInput:
        """A copy whose sampling tensors are on ``device`` (one packed copy per dtype, none when
        they are there already); every other field is shared with ``self``."""
        from phloem.runtime.host_copy import pack_to_device

        moved = pack_to_device(_tensor_fields(self.sampling), torch.device(device))
        return dataclasses.replace(self, sampling=_with_tensors(self.sampling, moved))

    def to(self, device: torch.device | str) -> ForwardInput:
        """Every tensor on ``device``. On a GPU the host tensors travel packed, one pinned staging
        buffer and one asynchronous copy per dtype (:func:`~phloem.runtime.host_copy.
        pack_to_device`), so the caller's thread never waits for the stream."""
        from phloem.runtime.host_copy import pack_to_device

        s, lp = self.sampling, self.logprobs
        top = [self.input_ids, self.positions, self.out_slots, self.req_pool_indices, self.seq_lens,
               self.prefix_lens, self.extend_lens]  # fmt: skip
        samp = _tensor_fields(s)
        lp_t = [lp.return_logprob] if lp is not None else []
        moved = pack_to_device([*top, *samp, *lp_t], torch.device(device))
        it = iter(moved)
        ids, pos, slots, rows, seq, prefix, extend = (next(it) for _ in range(len(top)))
        sampling = _with_tensors(s, [next(it) for _ in samp])
        if lp is not None:
            lp = LogprobRequest(
                return_logprob=next(it),  # type: ignore[arg-type]
                top_logprobs_nums=lp.top_logprobs_nums,
                token_ids_logprob=lp.token_ids_logprob,
                input_logprob_starts=lp.input_logprob_starts,
                processed=lp.processed,
            )
        return ForwardInput(
            mode=self.mode, input_ids=ids, positions=pos, out_slots=slots,  # type: ignore[arg-type]
            req_pool_indices=rows, seq_lens=seq, prefix_lens=prefix, extend_lens=extend,  # type: ignore[arg-type]
            sampling=sampling, logprobs=lp, tree_parents=self.tree_parents,
            return_hidden_states=self.return_hidden_states, key_pairs=self.host_key_pairs(),
        )  # fmt: skip

    def host_key_pairs(self) -> tuple[int, int] | None:
        """:attr:`key_pairs` of an extend batch, from host lengths (``None`` when they are on the
        device and were not counted before)."""
        if self.key_pairs is not None or self.mode != ForwardMode.EXTEND:
            return self.key_pairs
        if self.prefix_lens.device.type != "cpu" or self.extend_lens.device.type != "cpu":
            return None
        return extend_key_pairs(self.prefix_lens, self.extend_lens)


def extend_key_pairs(prefix_lens: torch.Tensor, extend_lens: torch.Tensor) -> tuple[int, int]:
    """Causal attention's query-key pairs of an extend batch: new tokens over their cached prefix
    (``sum p * e``), and new tokens over each other, themselves included (``sum e (e + 1) / 2``)."""
    p, e = prefix_lens.to(torch.int64), extend_lens.to(torch.int64)
    return int((p * e).sum()), int((e * (e + 1) // 2).sum())


def decode_step_input(fi: ForwardInput, j: int, input_ids: torch.Tensor) -> ForwardInput:
    """Step ``j`` of continuous decode batch ``fi``: one token per row at position ``prefix + j``,
    written to ``step_slots[j]``, reading ``input_ids`` (step ``j - 1``'s sampled tokens)."""
    assert fi.mode == ForwardMode.DECODE and fi.step_slots is not None and 0 <= j < fi.decode_steps
    prefix = fi.prefix_lens + j if j else fi.prefix_lens
    return dataclasses.replace(
        fi,
        input_ids=input_ids,
        positions=prefix,
        out_slots=fi.step_slots[j],
        seq_lens=fi.seq_lens + j if j else fi.seq_lens,
        prefix_lens=prefix,
        decode_steps=1,
        step_slots=None,
    )


def _tensor_fields(info: SamplingInfo) -> list[torch.Tensor | None]:
    """Every field of ``info`` in order: the tensors, and None for the rest."""
    return [v if isinstance(v, torch.Tensor) else None for v in vars(info).values()]


def _with_tensors(info: SamplingInfo, moved: list[Any]) -> SamplingInfo:
    """``info`` with its tensor fields replaced, in order, by ``moved`` (from :func:`_tensor_fields`)."""
    return SamplingInfo(**{
        k: (m if isinstance(v, torch.Tensor) else v) for (k, v), m in zip(vars(info).items(), moved)
    })  # fmt: skip


@dataclass
class TokenLogprobs:
    """Logprob results for one request in one forward pass (host side, plain Python)."""

    output_logprob: float | None = None  # logprob of the sampled token
    output_top: list[tuple[int, float]] | None = None  # top-k (token, logprob) at the sampled step
    output_token_ids: list[tuple[int, float]] | None = None  # requested ids (token, logprob)
    # Input logprobs for the requested new tokens: entry i is the logprob of new token
    # (start + i) given everything before it; the first position of a sequence has None.
    input_logprobs: list[float | None] | None = None
    input_top: list[list[tuple[int, float]]] | None = None
    input_token_ids: list[list[tuple[int, float]]] | None = None


@dataclass
class StepTime:
    """The device time of a launch's decode steps (``executor.step_timer``)."""

    steps: int
    read: Callable[[], float]  # seconds; call once the launch's tokens were read


@dataclass
class ForwardOutput:
    """Result of one forward pass plus sampling.

    ``next_token_ids`` stays on the device (the overlap loop feeds it to the next step without a
    host sync); ``copy_done`` fires once ``next_token_ids_cpu`` is valid to read.
    """

    next_token_ids: torch.Tensor  # [B] int64, device
    next_token_ids_cpu: torch.Tensor  # [B] int64, host (valid after copy_done)
    copy_done: torch.cuda.Event | None = None  # None on CPU: already valid
    # Builds the per-request logprobs (when asked) from host copies that are valid once
    # ``copy_done`` fired: the forward only queues those copies, so it never waits for the GPU.
    # Read them through :attr:`logprobs`.
    logprobs_fn: Callable[[], list[TokenLogprobs]] | None = None
    hidden_states: torch.Tensor | None = None  # [T, H] for speculative drafting, when asked
    # A continuous decode batch: each step's output in order (this object's own fields are the
    # last step's, whose tokens the next batch reads).
    steps: list[ForwardOutput] | None = None
    # The device time of the decode steps it carries (set by the worker; None for other passes)
    step_time: StepTime | None = None
    # A chain decode launch: every step's tokens ``[K, B, W]`` (-1 after each row's count) and
    # counts ``[K, B]``, host tensors valid once ``copy_done`` fired.
    chain: tuple[torch.Tensor, torch.Tensor] | None = None
    _logprobs: list[TokenLogprobs] | None = field(default=None, init=False, repr=False)

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        """Per-request logprobs, when the batch asked for them (waits for ``copy_done``)."""
        if self._logprobs is None and self.logprobs_fn is not None:
            if self.copy_done is not None:
                self.copy_done.synchronize()
            self._logprobs, self.logprobs_fn = self.logprobs_fn(), None
        return self._logprobs

    def synchronize(self) -> list[int]:
        if self.copy_done is not None:
            self.copy_done.synchronize()
        return self.next_token_ids_cpu.tolist()

    def synchronize_steps(self) -> list[list[int]]:
        """Tokens ``[step][row]`` of a continuous decode batch (one step: ``[synchronize()]``)."""
        if self.steps is None:
            return [self.synchronize()]
        self.synchronize()  # the steps ran in order on one stream: the last copy is the last done
        return [s.next_token_ids_cpu.tolist() for s in self.steps]
