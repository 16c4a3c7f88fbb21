"""Train an EAGLE draft head for a target model, from the target's own outputs (docs/design.md §7).

``phloem train-eagle --target PATH --out HEAD.safetensors`` runs :func:`train_eagle_main`::

    1. prompts (assets/train_prompts.txt, plus --mixed-prompts N from prompt_mix.py),
       chat-templated and tokenized; a held-out slice of the file is kept for the report
    2. the target answers each prompt (greedy, plus some sampled answers) in large batches; its
       final hidden state and argmax next token at every position are recorded on the way
       (answer_and_record: everything stays on the device, one small host sync per step)
    3. the head is trained with AdamW: smooth-L1 between predicted and true features plus
       cross-entropy against the labels, over a frequent-token draft vocabulary; with
       ``--unroll K`` the head is also trained on its own predicted features (depths 2..K).
       Prompt positions weigh ``--prompt-weight`` (drafts only ever start in an answer; a chat
       template's fixed system prompt would otherwise dominate both the loss and the score)
    4. the held-out prompts are decoded speculatively (EAGLE chain and tree) and the mean accept
       length is reported and stored in the file's metadata

The runner computes in float32 unless ``--dtype`` says otherwise: the shipped head serves the
CPU engine, whose default is float32, and for a small target a GPU decode step is bound by
kernel launches, not by arithmetic. ``--dtype bfloat16`` on CUDA trains against the features
the CUDA engine (``auto`` = bfloat16) produces.

``--tiny`` shrinks every stage to a smoke test that finishes in well under two minutes on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from phloem.runtime.cache.allocator import TokenSlotAllocator
from phloem.runtime.executor.model_runner import greedy_sampling_info
from phloem.runtime.forward_io import ForwardInput, ForwardMode
from phloem.runtime.speculative.decoding import EagleDrafter, SpeculativeDecoder
from phloem.runtime.speculative.eagle import EagleConfig, EagleDraftWorker, EagleHead, save_eagle_head
from phloem.runtime.speculative.verify import SpecSampling, target_probs

__all__ = [
    "TrainConfig",
    "TrainingData",
    "answer_and_record",
    "build_dataset",
    "evaluate_acceptance",
    "train_eagle_main",
    "train_head",
    "unrolled_features",
]

logger = logging.getLogger("phloem.train_eagle")

ASSETS = os.path.join(os.path.dirname(__file__), "assets")
DEFAULT_PROMPTS = os.path.join(ASSETS, "train_prompts.txt")


@dataclass(frozen=True)
class TrainConfig:
    max_new_tokens: int = 96
    sampled_fraction: float = 0.25  # sampled answers per prompt (1.5: one each, and a second for half)
    sample_temperature: float = 0.9
    gen_batch: int = 16
    epochs: int = 8
    batch_size: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.05
    reg_weight: float = 1.0
    cls_weight: float = 0.5
    feature_noise: float = 0.05
    prompt_weight: float = 0.1  # loss weight of prompt positions (drafting starts in the answer)
    unroll: int = 2  # training passes per batch: pass k feeds the head its own pass k-1 output
    unroll_weight: float = 0.5  # loss weight of pass k is unroll_weight ** (k - 1)
    draft_vocab: int = 16384
    heldout: int = 12
    eval_tokens: int = 48
    seed: int = 0
    time_budget_s: float | None = None  # training: the schedule is squeezed into this many seconds
    gen_time_budget_s: float | None = None  # data: no new generation batch starts past this
    val_every: int = 10  # sequences of every n-th prompt validate (best epoch kept); 0 = none

    @classmethod
    def tiny(cls) -> TrainConfig:
        return cls(max_new_tokens=16, sampled_fraction=0.0, gen_batch=8, epochs=2, batch_size=8,
                   draft_vocab=2048, heldout=2, eval_tokens=12)  # fmt: skip


# ---------------------------------------------------------------------------------- data
def read_prompts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]


def encode_prompts(texts: list[str], tokenizer: Any) -> list[list[int]]:
    out = []
    for t in texts:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": t}])
        except ValueError:
            text = t
        out.append(tokenizer.encode(text))
    return out


@dataclass
class Answers:
    """One generation batch, flat: sequence after sequence, one row per recorded position (every
    token of prompt + answer except the last). On the runner's device."""

    tokens: torch.Tensor  # [n] int64: the token at the position
    features: torch.Tensor  # [n, H] runner dtype: the target's final hidden state there
    labels: torch.Tensor  # [n] int64: the target's argmax next token there
    lengths: list[int]  # positions per sequence (len(prompt) + len(answer) - 1)
    prompt_lens: list[int]  # the first prompt_lens[s] positions of sequence s are its prompt


@dataclass
class TrainingData:
    """Every recorded position of every answer, flat (as :class:`Answers`), plus one padding row.

    Position ``p`` of sequence ``s`` is row ``starts[s] + p`` for ``0 <= p < lengths[s]``; row
    ``num_positions`` is padding (zero feature, token 0, label -100). Positions
    ``p < prompt_lens[s]`` lie in the prompt; the first answer token sits at ``prompt_lens[s]``,
    so drafting (which starts from that token) is trained by positions ``p >= prompt_lens[s]``.
    Lives on the GPU when it fits, otherwise in pinned host memory.
    """

    tokens: torch.Tensor  # [N + 1] int64
    features: torch.Tensor  # [N + 1, H] runner dtype
    labels: torch.Tensor  # [N + 1] int64
    starts: list[int]
    lengths: list[int]
    prompt_ids: list[int]
    prompt_lens: list[int]

    @property
    def num_positions(self) -> int:
        return self.tokens.shape[0] - 1

    def __len__(self) -> int:
        return len(self.lengths)


def _ranges(lens: torch.Tensor) -> torch.Tensor:
    """``cat([arange(n) for n in lens])`` without a Python loop."""
    starts = torch.cumsum(lens, 0) - lens
    return torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)


def _target_pass(runner: Any, fi: ForwardInput) -> torch.Tensor:
    """The target's final hidden states ``[T, H]`` for ``fi`` (device tensors), KV written."""
    runner.attn_backend.init_metadata(fi)
    return runner.model(fi.input_ids, fi.positions, runner.attn_backend)


@torch.inference_mode()
def answer_and_record(
    runner: Any,
    prompts: list[list[int]],
    max_new: int,
    *,
    allocator: TokenSlotAllocator,
    sampled: list[bool] | None = None,
    sampling: SpecSampling | None = None,
    seed: int = 0,
    stop_ids: frozenset[int] | set[int] = frozenset(),
) -> Answers:
    """Answer ``prompts`` together (greedy, or sampled with ``sampling`` where ``sampled[i]``),
    recording the target's feature and argmax label at every position.

    One extend pass over all prompts, then single-token decode passes built from device tensors:
    the picks, features and labels stay on the device and are gathered once at the end; the only
    host sync per step reads how many sequences are still running. Finished rows are dropped
    from the batch on the CPU at once; on a GPU only when half of them are done (the pass costs
    the same, and a steady batch size keeps compiled kernels reused). The KV slots come from
    ``allocator`` and are returned before this returns.
    """
    dev, b = runner.device, len(prompts)
    table = runner.req_to_token_pool.req_to_token
    plen = torch.tensor([len(p) for p in prompts])
    span = plen + max_new - 1  # KV positions a sequence writes (its last token has none)
    if int(span.max()) > table.shape[1]:
        raise ValueError("prompt + max_new_tokens exceeds the runner's context length")
    slots = allocator.alloc(int(span.sum()))
    if slots is None:
        raise RuntimeError("KV pool too small for one generation batch: lower --gen-batch")
    pool = runner.req_to_token_pool
    rows = [pool.alloc() for _ in prompts]
    try:
        if any(r is None for r in rows):
            raise RuntimeError("not enough req_to_token rows for one generation batch")
        rows_h = torch.tensor(rows, dtype=torch.int64)
        cols = _ranges(span)  # slots[k] serves position cols[k] of sequence owner[k]
        owner = torch.repeat_interleave(torch.arange(b), span)
        table[rows_h[owner].to(dev), cols.to(dev)] = slots.to(dev)
        prefill, hidden_p, labels_p = _record_prompts(runner, prompts, plen, span, slots, rows_h)
        last = (torch.cumsum(plen, 0) - 1).to(dev)
        picker = _Picker(sampled or [False] * b, sampling, seed, dev)
        decoded = _record_answers(runner, hidden_p[last], picker, plen, rows_h, max_new, stop_ids)
        return _gather_answers(prefill.input_ids, hidden_p, labels_p, plen, decoded)
    finally:
        allocator.free(slots)
        for r in rows:
            if r is not None:
                pool.free(r)


def _record_prompts(
    runner: Any,
    prompts: list[list[int]],
    plen: torch.Tensor,
    span: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
) -> tuple[ForwardInput, torch.Tensor, torch.Tensor]:
    """One extend pass over every prompt: its input, each position's feature ``[T, H]`` and label."""
    first = torch.cumsum(span, 0) - span
    pos = _ranges(plen)
    prefill = ForwardInput(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor([t for p in prompts for t in p], dtype=torch.int64),
        positions=pos,
        out_slots=slots[torch.repeat_interleave(first, plen) + pos],
        req_pool_indices=rows, seq_lens=plen, prefix_lens=torch.zeros_like(plen), extend_lens=plen,
        sampling=greedy_sampling_info(len(prompts)),
    ).to(runner.device)  # fmt: skip
    hidden = _target_pass(runner, prefill)
    return prefill, hidden, _argmax_labels(runner, hidden)


@dataclass
class _Decoded:
    tokens: torch.Tensor  # [B, max_new] answer tokens
    features: torch.Tensor  # [B, max_new - 1, H]: the feature at answer position s (fed token s)
    labels: torch.Tensor  # [B, max_new - 1]
    lengths: torch.Tensor  # [B] answer length (up to and including a stop token)


def _record_answers(
    runner: Any,
    hidden_last: torch.Tensor,
    picker: _Picker,
    plen: torch.Tensor,
    rows: torch.Tensor,
    max_new: int,
    stop_ids: frozenset[int] | set[int],
) -> _Decoded:
    """Single-token decode passes: step s picks answer token s of each running row, then feeds it
    to the target at position plen[i] + s, which records that position's feature and label.
    ``hidden_last`` is each prompt's last feature. The only host sync per step reads how many rows
    still run."""
    dev, b = runner.device, plen.numel()
    table = runner.req_to_token_pool.req_to_token
    m = max_new - 1
    out = _Decoded(
        tokens=torch.zeros(b, max_new, dtype=torch.int64, device=dev),
        features=hidden_last.new_zeros(b, m, hidden_last.shape[1]),
        labels=torch.zeros(b, m, dtype=torch.int64, device=dev),
        lengths=torch.full((b,), max_new, dtype=torch.int64, device=dev),
    )
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.int64, device=dev)
    act = torch.arange(b, device=dev)
    logits = runner.model.compute_logits(hidden_last)  # [B, V]
    top = logits.argmax(-1)
    # finished rows leave the batch at once on the CPU; on a GPU only once half are done (the pass
    # costs the same, and a steady batch size keeps compiled kernels reused)
    compact_below = 1.0 if dev.type == "cpu" else 0.5
    rows_d, plen_d = rows.to(dev), plen.to(dev)
    for s in range(max_new):
        tok = picker.pick(logits, top, act)
        out.tokens[act, s] = tok
        hit = torch.isin(tok, stops) & ~done[act]
        out.lengths.index_copy_(0, act, torch.where(hit, s + 1, out.lengths[act]))
        done.index_copy_(0, act, done[act] | hit)
        if s == m:
            break
        running = int((~done[act]).sum())  # the step's one host sync
        if running == 0:
            break
        if running < compact_below * act.numel():
            act = act[~done[act]]
        p = plen_d[act] + s
        fi = ForwardInput(
            mode=ForwardMode.DECODE, input_ids=out.tokens[act, s],
            positions=p, out_slots=table[rows_d[act], p], req_pool_indices=rows_d[act],
            seq_lens=p + 1, prefix_lens=p, extend_lens=torch.ones_like(p),
            sampling=greedy_sampling_info(act.numel()),
        )  # fmt: skip
        h = _target_pass(runner, fi)  # [A, H]
        logits = runner.model.compute_logits(h)
        top = logits.argmax(-1)
        out.features[act, s] = h
        out.labels[act, s] = top
    return out


def _gather_answers(
    prompt_ids: torch.Tensor, hidden_p: torch.Tensor, labels_p: torch.Tensor, plen: torch.Tensor, d: _Decoded
) -> Answers:
    """One gather per batch: each sequence's prompt rows, then the answer rows before its last token."""
    m = d.features.shape[1]
    n_ans = d.lengths.tolist()
    starts_p = (torch.cumsum(plen, 0) - plen).tolist()
    t_total = hidden_p.shape[0]
    idx = torch.cat([
        torch.cat([torch.arange(a, a + n), t_total + i * m + torch.arange(k - 1)])
        for i, (a, n, k) in enumerate(zip(starts_p, plen.tolist(), n_ans))
    ]).to(hidden_p.device)  # fmt: skip
    return Answers(
        tokens=torch.cat([prompt_ids, d.tokens[:, :m].reshape(-1)])[idx],
        features=torch.cat([hidden_p, d.features.reshape(-1, d.features.shape[2])])[idx],
        labels=torch.cat([labels_p, d.labels.reshape(-1)])[idx],
        lengths=[n + k - 1 for n, k in zip(plen.tolist(), n_ans)],
        prompt_lens=plen.tolist(),
    )


def _argmax_labels(runner: Any, hidden: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """``argmax(lm_head(hidden))`` row by row, in chunks (full-vocabulary logits are large)."""
    return torch.cat([runner.model.compute_logits(h).argmax(-1) for h in hidden.split(chunk)])


class _Picker:
    """The next token of each row: argmax, or a draw from the sampler's distribution for the rows
    marked ``sampled`` (one device generator, no host work)."""

    def __init__(self, sampled: list[bool], sampling: SpecSampling | None, seed: int, device: torch.device):
        self.any = any(sampled) and sampling is not None and not sampling.greedy
        self.sampling = sampling
        self.mask = torch.tensor(sampled, dtype=torch.bool).to(device)
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def pick(self, logits: torch.Tensor, top: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        """``top``: the argmax of ``logits``; ``act``: the batch rows of ``logits``."""
        if not self.any:
            return top
        assert self.sampling is not None
        draw = torch.multinomial(target_probs(logits, self.sampling), 1, generator=self.gen)[:, 0]
        return torch.where(self.mask[act], draw, top)


class _DataStore:
    """Preallocated flat arrays that generation batches are copied into, one copy each."""

    def __init__(self, capacity: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        feature_bytes = (capacity + 1) * (hidden * dtype.itemsize + 16)
        on_device = device.type == "cuda" and feature_bytes < 0.5 * torch.cuda.mem_get_info(device)[0]
        self.device = device if on_device else torch.device("cpu")
        pin = device.type == "cuda" and not on_device
        logger.info(
            "dataset store: up to %.2f GB on %s", feature_bytes / 1e9, "device" if on_device else "host"
        )

        def empty(*shape: int, dt: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=self.device, pin_memory=pin)

        self.tokens = empty(capacity + 1, dt=torch.int64)
        self.features = empty(capacity + 1, hidden, dt=dtype)
        self.labels = empty(capacity + 1, dt=torch.int64)
        self.starts: list[int] = []
        self.lengths: list[int] = []
        self.prompt_ids: list[int] = []
        self.prompt_lens: list[int] = []
        self.size = 0

    def add(self, ans: Answers, prompt_ids: list[int]) -> None:
        n = ans.tokens.shape[0]
        for dst, src in ((self.tokens, ans.tokens), (self.features, ans.features), (self.labels, ans.labels)):
            dst[self.size : self.size + n].copy_(src, non_blocking=True)
        for length, pid, plen in zip(ans.lengths, prompt_ids, ans.prompt_lens):
            self.starts.append(self.size)
            self.lengths.append(length)
            self.prompt_ids.append(pid)
            self.prompt_lens.append(plen)
            self.size += length

    def finish(self) -> TrainingData:
        n = self.size
        self.tokens[n], self.labels[n] = 0, -100
        self.features[n].zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return TrainingData(
            self.tokens[: n + 1], self.features[: n + 1], self.labels[: n + 1],
            self.starts, self.lengths, self.prompt_ids, self.prompt_lens,
        )  # fmt: skip


def build_dataset(
    runner: Any, prompts: list[list[int]], cfg: TrainConfig, stop_ids: set[int]
) -> TrainingData:
    """Greedy answers to every prompt, plus ``sampled_fraction`` sampled answers per prompt, in
    batches of ``gen_batch`` sequences (greedy and sampled rows mixed, in a seeded order so that a
    ``gen_time_budget_s`` cut keeps a fair sample)."""
    rng = random.Random(cfg.seed)
    ids = list(range(len(prompts)))
    whole, part = divmod(cfg.sampled_fraction, 1.0)
    jobs = [(i, False) for i in ids] + [
        (i, True) for i in ids * int(whole) + rng.sample(ids, int(len(ids) * part))
    ]
    rng.shuffle(jobs)
    sampling = SpecSampling(temperature=cfg.sample_temperature, top_p=0.95)
    capacity = sum(len(prompts[i]) + cfg.max_new_tokens - 1 for i, _ in jobs)
    store = _DataStore(capacity, runner.model_config.hidden_size, runner.dtype, runner.device)
    allocator = TokenSlotAllocator(runner.kv_pool.num_slots)
    t0 = time.monotonic()
    done = 0
    for b in range(0, len(jobs), cfg.gen_batch):
        if done and cfg.gen_time_budget_s is not None and time.monotonic() - t0 > cfg.gen_time_budget_s:
            logger.info("data: time budget reached after %d of %d sequences", done, len(jobs))
            break
        chunk = jobs[b : b + cfg.gen_batch]
        ans = answer_and_record(
            runner, [prompts[i] for i, _ in chunk], cfg.max_new_tokens, allocator=allocator,
            sampled=[s for _, s in chunk], sampling=sampling, seed=cfg.seed + b, stop_ids=stop_ids,
        )  # fmt: skip
        store.add(ans, [i for i, _ in chunk])
        done += len(chunk)
        logger.info(
            "data: %d/%d sequences, %d positions, %.0fs", done, len(jobs), store.size, time.monotonic() - t0
        )
    return store.finish()


def choose_draft_vocab(labels: list[torch.Tensor], vocab: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent label tokens, topped up with the lowest ids (BPE merge order is
    roughly frequency order). Sorted ascending."""
    if size >= vocab:
        return torch.arange(vocab)
    counts = torch.bincount(torch.cat([y.cpu() for y in labels]), minlength=vocab).float()
    counts += torch.linspace(1e-3, 0, vocab)  # ties (mostly zeros) broken towards low ids
    return counts.topk(size).indices.sort().values


# ---------------------------------------------------------------------------------- training
def unroll_mask(n: int, k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Attention mask ``[n, k * n]`` (True = attend) of training pass ``k`` (1-based) over the keys
    of passes ``1 .. k`` laid side by side.

    Pass ``k`` at position ``j`` is a depth-``k`` draft step: positions ``<= j - k + 1`` are
    committed (their keys come from true features: pass 1), and the draft chain above them put
    one key at each later position, the one at ``j - k + m`` from pass ``m``::

        key (pass 1, i)   allowed  iff  i <= j - k + 1
        key (pass m, i)   allowed  iff  i == j - k + m          (m = 2 .. k)

    ``k == 1`` is the plain causal mask.
    """
    j = torch.arange(n, device=device)[:, None]
    i = torch.arange(n, device=device)[None, :]
    blocks = [i <= j - k + 1] + [i == j - k + m for m in range(2, k + 1)]
    return torch.cat(blocks, dim=1)


def unrolled_features(
    head: EagleHead, emb: torch.Tensor, feat_in: torch.Tensor, unroll: int
) -> list[torch.Tensor]:
    """The head's predicted features ``[B, L, H]`` of training passes ``1 .. unroll``.

    Pass 1 is :meth:`EagleHead.forward_dense`: position ``j`` sees ``(t_j, feat_in[j])``. Pass
    ``k > 1`` feeds position ``j`` the pass ``k - 1`` output at ``j - 1`` (zero at ``j = 0``) and
    attends as a depth-``k`` draft step would (:func:`unroll_mask`). Only positions
    ``j >= k - 1`` of pass ``k`` have a drafting counterpart; gradients flow through all passes.
    """
    b, n, _ = emb.shape
    positions = torch.arange(n, device=emb.device).expand(b, n)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    feat = feat_in
    for k in range(1, unroll + 1):
        x, q, key, v = head.project(emb, feat, positions)  # q [B, L, Hq, D], key/v [B, L, Hk, D]
        keys.append(key.transpose(1, 2))
        values.append(v.transpose(1, 2))
        mask = None if k == 1 else unroll_mask(n, k, emb.device)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), torch.cat(keys, 2), torch.cat(values, 2),
            attn_mask=mask, is_causal=k == 1, enable_gqa=True,
        )  # fmt: skip  # [B, Hq, L, D]
        g = head.finish(x, o.transpose(1, 2))
        outs.append(g)
        feat = F.pad(g[:, :-1], (0, 0, 1, 0))  # position j sees g[j - 1]
    return outs


@dataclass
class _Batch:
    tokens: torch.Tensor  # [B, L]
    feat_in: torch.Tensor  # [B, L, H] float32: f_{j-1} (zero at j = 0)
    feat_out: torch.Tensor  # [B, L, H] float32: f_j
    labels: torch.Tensor  # [B, L] draft-vocabulary ids, -100 = none
    valid: torch.Tensor  # [B, L] bool
    answer: torch.Tensor  # [B, L] bool: valid positions in the answer (where drafting happens)


def _gather(data: TrainingData, seqs: list[int], to_draft: torch.Tensor, device: torch.device) -> _Batch:
    """Pad ``seqs`` to a batch with one gather per array (indices built on the host)."""
    lens = torch.tensor([data.lengths[s] for s in seqs])[:, None]
    start = torch.tensor([data.starts[s] for s in seqs])[:, None]
    plen = torch.tensor([data.prompt_lens[s] for s in seqs])[:, None]
    j = torch.arange(int(lens.max()))[None, :]
    valid = j < lens
    answer = (valid & (j >= plen)).to(device)
    pad = data.num_positions
    here = torch.where(valid, start + j, pad).to(data.tokens.device)
    prev = torch.where(valid & (j > 0), start + j - 1, pad).to(data.tokens.device)
    valid = valid.to(device)
    labels = to_draft[data.labels[here].clamp(min=0).to(device)]  # the padding row holds -100
    return _Batch(
        tokens=data.tokens[here].to(device),
        feat_in=data.features[prev].to(device, torch.float32),
        feat_out=data.features[here].to(device, torch.float32),
        labels=torch.where(valid, labels, -100),
        valid=valid,
        answer=answer,
    )


def _batch_loss(
    head: EagleHead, batch: _Batch, *, embed_weight: torch.Tensor, draft_lm: torch.Tensor, cfg: TrainConfig,
    noise: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Loss of one padded batch, summed over the unrolled passes (pass ``k`` weighted by
    ``unroll_weight ** (k - 1)``; prompt positions by ``prompt_weight``), and per pass: draft
    top-1 hits and labelled positions *in the answer* (``[unroll]`` tensors on the device).

    Prompt positions still count a little: their keys are the context every draft attends to.
    Only answer positions are ever drafted from, so only they are scored.
    """
    feat_in = batch.feat_in
    if noise is not None and cfg.feature_noise > 0:
        u = torch.rand(feat_in.shape, generator=noise, device=feat_in.device)
        feat_in = feat_in + (u - 0.5) * 2 * cfg.feature_noise
    emb = F.embedding(batch.tokens, embed_weight.float())
    outs = unrolled_features(head, emb, feat_in, cfg.unroll)
    j = torch.arange(batch.valid.shape[1], device=batch.valid.device)
    scale = torch.where(batch.answer, 1.0, cfg.prompt_weight)  # [B, L]
    loss = emb.new_zeros(())
    hits, counts = [], []
    for k, g in enumerate(outs):  # masks as weights: no data-dependent shapes, no host sync
        mask = batch.valid & (j >= k)  # pass k + 1 starts where a depth-(k + 1) draft can
        w = mask.float() * scale
        reg = (F.smooth_l1_loss(g, batch.feat_out, reduction="none").mean(-1) * w).sum() / w.sum().clamp(
            min=1e-6
        )
        lab = torch.where(mask, batch.labels, -100)
        logits = F.linear(g, draft_lm)  # [B, L, Vd]
        ce = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="none")
        wl = (w * (lab >= 0)).flatten()
        cls = (ce * wl).sum() / wl.sum().clamp(min=1e-6)
        loss = loss + cfg.unroll_weight**k * (cfg.reg_weight * reg + cfg.cls_weight * cls)
        scored = (lab >= 0) & batch.answer
        hits.append(((logits.argmax(-1) == lab) & scored).sum())
        counts.append(scored.sum())
    return loss, torch.stack(hits), torch.stack(counts)


def _lr_factor(progress: float, warmup: float = 0.1) -> float:
    """Linear warm-up from 1/25 to 1 over the first ``warmup`` of training, then cosine to 0."""
    if progress < warmup:
        return 0.04 + 0.96 * progress / warmup
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (progress - warmup) / (1.0 - warmup))))


def _split(data: TrainingData, every: int) -> tuple[list[int], list[int]]:
    every = every if len(data) >= 20 else 0
    val = [i for i, p in enumerate(data.prompt_ids) if every and p % every == 0]
    held = set(val)
    return [i for i in range(len(data)) if i not in held], val


def _groups(data: TrainingData, seqs: list[int], size: int, rng: random.Random) -> list[list[int]]:
    """Length-sorted groups of ``size`` sequences (little padding), in a shuffled order."""
    order = sorted(seqs, key=lambda i: data.lengths[i])
    groups = [order[i : i + size] for i in range(0, len(order), size)]
    rng.shuffle(groups)
    return groups


@contextlib.contextmanager
def _fast_matmul(device: torch.device) -> Iterator[None]:
    """TF32 matmuls while the head trains on a GPU (the target's passes keep full float32)."""
    if device.type != "cuda":
        yield
        return
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def train_head(
    head: EagleHead,
    data: TrainingData,
    *,
    embed_weight: torch.Tensor,
    lm_weight: torch.Tensor,
    cfg: TrainConfig,
) -> list[dict[str, Any]]:
    """AdamW over the recorded sequences; returns per-epoch train loss and validation top-1.

    For a sequence ``t_0 .. t_{L-1}`` with features ``f_0 .. f_{L-2}``, draft position ``j``
    (``0 <= j <= L-2``) sees ``(t_j, f_{j-1})`` (``f_{-1} = 0``) and is trained towards ``f_j``
    (smooth L1) and the label ``y_j`` (cross-entropy over the draft vocabulary; labels outside
    it count for the feature loss only); positions in the prompt weigh ``prompt_weight`` and
    validation scores answer positions only. With ``unroll > 1`` the later passes of
    :func:`unrolled_features` are trained towards the same targets. Sequences of every
    ``val_every``-th prompt are held out for validation; the head keeps the weights of the epoch
    with the best validation top-1 (mean over passes). The learning rate warms up and decays
    over ``epochs``, or over ``time_budget_s`` seconds when that ends first.
    """
    if cfg.unroll < 1:
        raise ValueError(f"unroll must be >= 1, got {cfg.unroll}")
    rng = random.Random(cfg.seed)
    device = embed_weight.device
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    head.to(device).train()
    to_draft = torch.full((embed_weight.shape[0],), -100, dtype=torch.int64)
    to_draft[head.token_map.cpu()] = torch.arange(head.token_map.numel())
    to_draft = to_draft.to(device)
    draft_lm = lm_weight[head.token_map.to(device)].detach().float()
    train, val = _split(data, cfg.val_every)
    kw: dict[str, Any] = dict(embed_weight=embed_weight, draft_lm=draft_lm, cfg=cfg)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = max(cfg.epochs * math.ceil(len(train) / cfg.batch_size), 1)
    history: list[dict[str, Any]] = []
    best, best_state, t0, step = -1.0, None, time.monotonic(), 0
    progress = 0.0
    with _fast_matmul(device):
        for epoch in range(cfg.epochs):
            total = torch.zeros((), device=device)
            count = 0
            for seqs in _groups(data, train, cfg.batch_size, rng):
                elapsed = time.monotonic() - t0
                progress = max(step / steps, elapsed / cfg.time_budget_s if cfg.time_budget_s else 0.0)
                if progress >= 1.0:
                    break
                for group in opt.param_groups:
                    group["lr"] = cfg.lr * _lr_factor(progress)
                loss, _, _ = _batch_loss(head, _gather(data, seqs, to_draft, device), noise=gen, **kw)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
                opt.step()
                total, count, step = total + loss.detach(), count + 1, step + 1
            if count == 0:  # the budget ran out at this epoch's first batch: nothing new to score
                break
            top1 = _validate(head, data, val, to_draft, kw)
            history.append({"train_loss": float(total) / max(count, 1), "val_top1": top1, "steps": step})
            logger.info("epoch %d: loss %.4f, validation top-1 by depth %s (%.0fs)", epoch + 1,
                        history[-1]["train_loss"], [round(v, 3) for v in top1], time.monotonic() - t0)  # fmt: skip
            score = sum(top1) / len(top1)
            if score >= best or not val:
                best, best_state = score, {k: v.detach().clone() for k, v in head.state_dict().items()}
            if progress >= 1.0:
                logger.info("time budget reached in epoch %d", epoch + 1)
                break
    if best_state is not None:
        head.load_state_dict(best_state)
    head.cpu().eval()
    return history


@torch.no_grad()
def _validate(
    head: EagleHead, data: TrainingData, seqs: list[int], to_draft: torch.Tensor, kw: dict[str, Any]
) -> list[float]:
    """Draft top-1 accuracy of each unrolled pass over ``seqs`` (zeros when there are none)."""
    unroll = kw["cfg"].unroll
    if not seqs:
        return [0.0] * unroll
    head.eval()
    device = kw["embed_weight"].device
    hits = torch.zeros(unroll, dtype=torch.int64, device=device)
    total = torch.zeros(unroll, dtype=torch.int64, device=device)
    for i in range(0, len(seqs), 16):
        _, h, n = _batch_loss(head, _gather(data, seqs[i : i + 16], to_draft, device), noise=None, **kw)
        hits, total = hits + h, total + n
    head.train()
    return (hits.float() / total.clamp(min=1)).tolist()


def evaluate_acceptance(
    runner: Any, head: EagleHead, prompts: list[list[int]], *, max_new: int, num_steps: int, topk: int,
    num_draft_tokens: int, stop_ids: set[int],
) -> float:  # fmt: skip
    """Mean accept length (tokens per verify) of greedy EAGLE decoding over ``prompts``."""
    worker = EagleDraftWorker.for_runner(
        head, runner, num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens
    )
    dec = SpeculativeDecoder(runner, EagleDrafter(worker))
    lens: list[int] = []
    for p in prompts:
        lens += dec.generate([p], max_new, stop_ids=stop_ids)[0].accept_lengths
    return sum(lens) / max(len(lens), 1)


# ---------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="phloem train-eagle", description="Train an EAGLE draft head for a target."
    )
    p.add_argument("--target", default=None, help="target model: GGUF file, HF directory, or dummy shape")
    p.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"])
    p.add_argument("--out", required=True, help="output .safetensors path")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="one prompt per line")
    p.add_argument("--mixed-prompts", type=int, default=0,
                   help="also train on this many templated prompts (speculative/prompt_mix.py)")  # fmt: skip
    p.add_argument(
        "--tiny", action="store_true", help="smoke test: few prompts, short answers, small head vocab"
    )
    for f in fields(TrainConfig):
        kind = float if f.default is None else type(f.default)
        p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--device", default="cpu", help="cpu or cuda (data generation and training)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                   help="the target's compute dtype while recording features and evaluating")  # fmt: skip
    return p


def train_eagle_main(argv: list[str] | None = None) -> int:
    """Entry point of ``phloem train-eagle``. Returns the process exit code."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    base = TrainConfig.tiny() if args.tiny else TrainConfig()
    overrides = {k: getattr(args, k) for k in vars(base) if getattr(args, k, None) is not None}
    cfg = TrainConfig(**{**vars(base), **overrides})
    torch.manual_seed(cfg.seed)
    t_start = time.monotonic()

    from phloem.runtime.executor.model_runner import ModelRunner
    from phloem.runtime.model_files import resolve_model

    source = resolve_model(args.target, args.load_format)
    runner = ModelRunner(source, dtype=args.dtype, device=args.device, attention_backend="auto",
                         max_total_tokens=max(1 << 15, cfg.gen_batch * (cfg.max_new_tokens + 320)),
                         max_running_requests=max(64, cfg.gen_batch), cuda_graph_max_bs=0,
                         cpu_threads=args.threads)  # fmt: skip
    heldout, train_prompts, stop_ids = _split_prompts(args, source, runner.vocab_size, cfg)
    data = build_dataset(runner, train_prompts, cfg, stop_ids)
    model = runner.model
    embed = model.model.embed_tokens.weight.detach()  # on the runner's device
    lm = (
        model.lm_head.tied_to.weight if model.lm_head.tied_to is not None else model.lm_head.weight
    ).detach()
    head = EagleHead(EagleConfig.from_target(runner.model_config, draft_vocab_size=cfg.draft_vocab))
    head.reset_parameters(torch.Generator().manual_seed(cfg.seed))
    head.token_map = choose_draft_vocab([data.labels[:-1]], runner.vocab_size, head.cfg.draft_vocab_size)
    t_data = time.monotonic() - t_start
    n_seqs, n_positions = len(data), data.num_positions
    logger.info("dataset: %d sequences, %d positions (%.0fs)", n_seqs, n_positions, t_data)

    history = train_head(head, data, embed_weight=embed.float(), lm_weight=lm.float(), cfg=cfg)
    t_train = time.monotonic() - t_start - t_data
    del data

    evals, accept = _evaluate(runner, head, heldout, cfg, stop_ids)
    info = {
        "target": source.name,
        "train_sequences": n_seqs,
        "train_positions": n_positions,
        "config": vars(cfg),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "epochs": history,
        "heldout_prompts": len(heldout),
        "heldout_accept_length": accept,
        "eval_settings": evals,
        "seconds": {"data": round(t_data, 1), "train": round(t_train, 1)},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_eagle_head(head, args.out, info=info)
    logger.info(
        "saved %s (%.1f MB) in %.0fs", args.out, os.path.getsize(args.out) / 2**20, time.monotonic() - t_start
    )
    print({"out": args.out, "heldout_accept_length": accept, "epochs": history})
    return 0


# Held-out decoding settings: a chain, a tree, and the 16-node tree a GPU verifies as fast as 8.
_EVALS: dict[str, dict[str, int]] = {
    "chain": dict(num_steps=4, topk=1, num_draft_tokens=5),
    "tree": dict(num_steps=4, topk=4, num_draft_tokens=8),
    "tree-16": dict(num_steps=6, topk=4, num_draft_tokens=16),
}


def _split_prompts(
    args: argparse.Namespace, source: Any, vocab: int, cfg: TrainConfig
) -> tuple[list[list[int]], list[list[int]], set[int]]:
    """The held-out prompts (the file's first ``cfg.heldout``), the training prompts (the rest of
    the file plus ``--mixed-prompts`` templated ones) and the target's stop ids."""
    prompts, stop_ids = _tokenized_prompts(source, read_prompts(args.prompts), vocab, cfg)
    if args.tiny:
        prompts = prompts[: 8 + cfg.heldout]
    heldout, train_prompts = prompts[: cfg.heldout], prompts[cfg.heldout :]
    if args.mixed_prompts:
        from phloem.training.prompt_mix import mixed_prompts

        extra, _ = _tokenized_prompts(source, mixed_prompts(args.mixed_prompts, cfg.seed), vocab, cfg)
        train_prompts += extra
    logger.info("%d training prompts, %d held out", len(train_prompts), len(heldout))
    return heldout, train_prompts, stop_ids


def _evaluate(
    runner: Any, head: EagleHead, heldout: list[list[int]], cfg: TrainConfig, stop_ids: set[int]
) -> tuple[dict[str, dict[str, int]], dict[str, float]]:
    """Mean accept length on the held-out prompts, per setting of :data:`_EVALS`."""
    accept = {
        name: evaluate_acceptance(runner, head, heldout, max_new=cfg.eval_tokens, stop_ids=stop_ids, **kw)
        for name, kw in _EVALS.items()
    }
    for name, value in accept.items():
        logger.info("held-out accept length (%s %s): %.3f", name, _EVALS[name], value)
    return _EVALS, accept


def _tokenized_prompts(
    source: Any, texts: list[str], vocab: int, cfg: TrainConfig
) -> tuple[list[list[int]], set[int]]:
    """Chat-templated prompts and the stop ids; a target without a tokenizer (a dummy shape)
    gets deterministic pseudo-random prompts, one per text line."""
    try:
        from phloem.runtime.tokenizer.tokenizer import load_tokenizer

        tok = load_tokenizer(source)
    except (ValueError, FileNotFoundError):
        gen = torch.Generator().manual_seed(cfg.seed)
        return [torch.randint(3, vocab, (8 + len(t) % 24,), generator=gen).tolist() for t in texts], set()
    return encode_prompts(texts, tok), set(tok.eos_token_ids)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(train_eagle_main())
