"""Train an EAGLE draft head for a target model, from the target's own outputs (DESIGN.md §7).

``phloem train-eagle --target PATH --out HEAD.safetensors`` runs :func:`train_eagle_main`::

    1. prompts (assets/train_prompts.txt), chat-templated and tokenized; a held-out slice is kept
    2. the target answers each prompt (greedy, plus some sampled answers) and its final hidden
       state at every position is recorded on the way (prefill + one feature per decode step)
    3. labels: the target's argmax next token at every position (from the recorded features)
    4. the head is trained with AdamW: smooth-L1 between predicted and true features plus
       cross-entropy against the labels, over a frequent-token draft vocabulary
    5. the held-out prompts are decoded speculatively (EAGLE chain and tree) and the mean accept
       length is reported and stored in the file's metadata

``--tiny`` shrinks every stage to a smoke test that finishes in well under two minutes on a CPU.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from phloem.runtime.cache.allocator import TokenSlotAllocator
from phloem.runtime.speculative.decoding import EagleDrafter, SpeculativeDecoder, target_forward
from phloem.runtime.speculative.eagle import EagleConfig, EagleDraftWorker, EagleHead, save_eagle_head
from phloem.runtime.speculative.verify import GREEDY, SpecSampling, target_probs

__all__ = ["TrainConfig", "build_dataset", "evaluate_acceptance", "train_eagle_main", "train_head"]

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
    draft_vocab: int = 8192
    heldout: int = 12
    eval_tokens: int = 48
    seed: int = 0
    time_budget_s: float | None = None  # stop training early past this many seconds
    val_every: int = 10  # sequences of every n-th prompt validate (best epoch kept); 0 = none

    @classmethod
    def tiny(cls) -> TrainConfig:
        return cls(max_new_tokens=16, sampled_fraction=0.0, gen_batch=8, epochs=2, batch_size=8,
                   draft_vocab=2048, heldout=2, eval_tokens=12)  # fmt: skip


@dataclass
class Sequence_:
    tokens: list[int]  # prompt + answer
    features: torch.Tensor  # [len(tokens) - 1, H]: the target's final hidden state per position
    prompt_id: int = 0


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


@torch.inference_mode()
def answer_and_record(
    runner: Any,
    prompts: list[list[int]],
    max_new: int,
    sampling: SpecSampling,
    *,
    seed: int,
    stop_ids: set[int],
) -> list[Sequence_]:
    """Plain batched decoding (the runner's own decode attention) that keeps the target's features."""
    pool = runner.req_to_token_pool
    alloc = TokenSlotAllocator(runner.kv_pool.num_slots)
    gen = torch.Generator().manual_seed(seed)
    rows = [pool.alloc() for _ in prompts]

    def pick(logits: torch.Tensor) -> list[int]:
        if sampling.greedy:
            return logits.argmax(-1).tolist()
        return torch.multinomial(target_probs(logits, sampling).cpu(), 1, generator=gen)[:, 0].tolist()

    try:
        logits, hidden = target_forward(runner, rows, prompts, [alloc.alloc(len(p)) for p in prompts])
        toks = [[*p, t] for p, t in zip(prompts, pick(logits))]
        feats = [[h.float().cpu()] for h in hidden]
        active = [i for i, t in enumerate(toks) if t[-1] not in stop_ids]
        for _ in range(max_new - 1):
            if not active:
                break
            kv = [len(toks[i]) - 1 for i in active]
            logits, hidden = target_forward(
                runner, [rows[i] for i in active], [[toks[i][-1]] for i in active],
                [alloc.alloc(1) for _ in active], prefix_lens=kv,
            )  # fmt: skip
            for i, t, h in zip(active, pick(logits), hidden):
                feats[i].append(h.float().cpu())
                toks[i].append(t)
            active = [i for i in active if toks[i][-1] not in stop_ids]
    finally:
        for r in rows:
            pool.free(r)
    return [Sequence_(t, torch.cat(f)) for t, f in zip(toks, feats)]


def build_dataset(
    runner: Any, prompts: list[list[int]], cfg: TrainConfig, stop_ids: set[int]
) -> list[Sequence_]:
    """Greedy answers to every prompt, plus ``sampled_fraction`` sampled answers per prompt."""
    rng = random.Random(cfg.seed)
    ids = list(range(len(prompts)))
    sampled = SpecSampling(temperature=cfg.sample_temperature, top_p=0.95)
    whole, part = divmod(cfg.sampled_fraction, 1.0)
    jobs = [(i, GREEDY) for i in ids] + [
        (i, sampled) for i in ids * int(whole) + rng.sample(ids, int(len(ids) * part))
    ]
    data: list[Sequence_] = []
    t0 = time.monotonic()
    for mode in (GREEDY, sampled):
        group = sorted((i for i, s in jobs if s == mode), key=lambda i: len(prompts[i]))
        for b in range(0, len(group), cfg.gen_batch):
            chunk = group[b : b + cfg.gen_batch]
            seqs = answer_and_record(runner, [prompts[i] for i in chunk], cfg.max_new_tokens, mode,
                                     seed=cfg.seed + b, stop_ids=stop_ids)  # fmt: skip
            for i, seq in zip(chunk, seqs):
                seq.prompt_id = i
            data += seqs
            logger.info("data: %d/%d sequences, %.0fs", len(data), len(jobs), time.monotonic() - t0)
    return data


@torch.inference_mode()
def target_labels(data: list[Sequence_], lm_weight: torch.Tensor) -> list[torch.Tensor]:
    """The target's greedy next token at every recorded position: ``argmax(lm_head(f_j))``."""
    return [F.linear(s.features.to(lm_weight), lm_weight).argmax(-1).cpu() for s in data]


def choose_draft_vocab(labels: list[torch.Tensor], vocab: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent label tokens, topped up with the lowest ids (BPE merge order is
    roughly frequency order). Sorted ascending."""
    if size >= vocab:
        return torch.arange(vocab)
    counts = torch.bincount(torch.cat(labels), minlength=vocab).float()
    counts += torch.linspace(1e-3, 0, vocab)  # ties (mostly zeros) broken towards low ids
    return counts.topk(size).indices.sort().values


# ---------------------------------------------------------------------------------- training
def _batches(data: list[Sequence_], labels: list[torch.Tensor], size: int, rng: random.Random):
    order = sorted(range(len(data)), key=lambda i: len(data[i].tokens))
    groups = [order[i : i + size] for i in range(0, len(order), size)]
    rng.shuffle(groups)
    yield from ((g, [data[i] for i in g], [labels[i] for i in g]) for g in groups)


def _batch_loss(
    head: EagleHead, seqs: list[Sequence_], labs: list[torch.Tensor], *, embed_weight: torch.Tensor,
    draft_lm: torch.Tensor, to_draft: torch.Tensor, cfg: TrainConfig, noise: torch.Generator | None,
) -> tuple[torch.Tensor, int, int]:  # fmt: skip
    """Loss of one padded batch, and (draft top-1 == label, labelled positions) counts."""
    n = max(len(s.tokens) - 1 for s in seqs)
    h, device = embed_weight.shape[1], embed_weight.device
    tok = torch.zeros(len(seqs), n, dtype=torch.int64)
    feat_in = torch.zeros(len(seqs), n, h)
    feat_out = torch.zeros(len(seqs), n, h)
    lab = torch.full((len(seqs), n), -100, dtype=torch.int64)
    valid = torch.zeros(len(seqs), n, dtype=torch.bool)
    for b, (s, y) in enumerate(zip(seqs, labs)):
        m = len(s.tokens) - 1
        tok[b, :m] = torch.tensor(s.tokens[:m])
        feat_in[b, 1:m] = s.features[: m - 1]  # position j sees f_{j-1}
        feat_out[b, :m] = s.features  # and predicts f_j
        lab[b, :m] = to_draft[y]
        valid[b, :m] = True
    if noise is not None and cfg.feature_noise > 0:
        feat_in = feat_in + (torch.rand(feat_in.shape, generator=noise) - 0.5) * 2 * cfg.feature_noise
    tok, feat_in, feat_out, lab, valid = (t.to(device) for t in (tok, feat_in, feat_out, lab, valid))
    g = head.forward_dense(F.embedding(tok, embed_weight.float()), feat_in)[valid]
    logits = F.linear(g, draft_lm)
    reg = F.smooth_l1_loss(g, feat_out[valid])
    cls = F.cross_entropy(logits, lab[valid], ignore_index=-100)
    hits = int(((logits.argmax(-1) == lab[valid]) & (lab[valid] >= 0)).sum())
    return cfg.reg_weight * reg + cfg.cls_weight * cls, hits, int((lab[valid] >= 0).sum())


def train_head(
    head: EagleHead,
    data: list[Sequence_],
    labels: list[torch.Tensor],
    *,
    embed_weight: torch.Tensor,
    lm_weight: torch.Tensor,
    cfg: TrainConfig,
) -> list[dict[str, float]]:
    """AdamW over the recorded sequences; returns per-epoch train loss and validation top-1.

    For a sequence ``t_0 .. t_{L-1}`` with features ``f_0 .. f_{L-2}``, draft position ``j``
    (``0 <= j <= L-2``) sees ``(t_j, f_{j-1})`` (``f_{-1} = 0``) and is trained towards ``f_j``
    (smooth L1) and the label ``y_j`` (cross-entropy over the draft vocabulary; labels outside
    it count for the feature loss only). Sequences of every tenth prompt are held out for
    validation; the head keeps the weights of the epoch with the best validation top-1.
    """
    rng = random.Random(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    device = embed_weight.device
    head.to(device).train()
    to_draft = torch.full((embed_weight.shape[0],), -100, dtype=torch.int64)
    to_draft[head.token_map.cpu()] = torch.arange(head.token_map.numel())
    draft_lm = lm_weight[head.token_map.to(device)].detach().float()
    every = cfg.val_every
    val_ids = (
        {i for i, s in enumerate(data) if s.prompt_id % every == 0} if every and len(data) >= 20 else set()
    )
    train = [i for i in range(len(data)) if i not in val_ids]
    kw: dict[str, Any] = dict(embed_weight=embed_weight, draft_lm=draft_lm, to_draft=to_draft, cfg=cfg)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.epochs * math.ceil(len(train) / cfg.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=max(steps, 1), pct_start=0.1)
    history: list[dict[str, float]] = []
    best, best_state, t0 = -1.0, None, time.monotonic()
    for epoch in range(cfg.epochs):
        total, count = 0.0, 0
        for _, seqs, labs in _batches(
            [data[i] for i in train], [labels[i] for i in train], cfg.batch_size, rng
        ):
            loss, _, _ = _batch_loss(head, seqs, labs, noise=gen, **kw)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opt.step()
            sched.step()
            total, count = total + float(loss.detach()), count + 1
        val = _validate(head, [data[i] for i in val_ids], [labels[i] for i in val_ids], kw)
        history.append({"train_loss": total / max(count, 1), "val_top1": val})
        logger.info("epoch %d: loss %.4f, validation top-1 %.3f (%.0fs)", epoch + 1, history[-1]["train_loss"], val,
                    time.monotonic() - t0)  # fmt: skip
        if val >= best or not val_ids:
            best, best_state = val, {k: v.detach().clone() for k, v in head.state_dict().items()}
        if cfg.time_budget_s is not None and time.monotonic() - t0 > cfg.time_budget_s:
            logger.info("time budget reached after epoch %d", epoch + 1)
            break
    if best_state is not None:
        head.load_state_dict(best_state)
    head.cpu().eval()
    return history


@torch.no_grad()
def _validate(
    head: EagleHead, data: list[Sequence_], labels: list[torch.Tensor], kw: dict[str, Any]
) -> float:
    if not data:
        return 0.0
    head.eval()
    hits = total = 0
    for i in range(0, len(data), 16):
        _, h, n = _batch_loss(head, data[i : i + 16], labels[i : i + 16], noise=None, **kw)
        hits, total = hits + h, total + n
    head.train()
    return hits / max(total, 1)


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
    for name, default in vars(TrainConfig()).items():
        if name == "time_budget_s":
            p.add_argument("--time-budget-s", type=float, default=None)
            continue
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--device", default="cpu", help="cpu or cuda (data generation and training)")
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
    runner = ModelRunner(source, dtype="float32", device=args.device, attention_backend="auto",
                         max_total_tokens=max(1 << 15, cfg.gen_batch * (cfg.max_new_tokens + 256)),
                         max_running_requests=max(64, cfg.gen_batch))  # fmt: skip
    texts = read_prompts(args.prompts)
    prompts, stop_ids = _tokenized_prompts(source, texts, runner.vocab_size, cfg)
    if args.tiny:
        prompts = prompts[: 8 + cfg.heldout]
    heldout, train_prompts = prompts[: cfg.heldout], prompts[cfg.heldout :]
    if args.mixed_prompts:
        from phloem.runtime.speculative.prompt_mix import mixed_prompts

        extra, _ = _tokenized_prompts(source, mixed_prompts(args.mixed_prompts, cfg.seed), runner.vocab_size, cfg)
        train_prompts += extra
    logger.info("%d training prompts, %d held out", len(train_prompts), len(heldout))

    data = build_dataset(runner, train_prompts, cfg, stop_ids)
    model = runner.model
    embed = model.model.embed_tokens.weight.detach()  # on the runner's device
    lm = (
        model.lm_head.tied_to.weight if model.lm_head.tied_to is not None else model.lm_head.weight
    ).detach()
    labels = target_labels(data, lm)
    head = EagleHead(EagleConfig.from_target(runner.model_config, draft_vocab_size=cfg.draft_vocab))
    head.reset_parameters(torch.Generator().manual_seed(cfg.seed))
    head.token_map = choose_draft_vocab(labels, runner.vocab_size, head.cfg.draft_vocab_size)
    t_data = time.monotonic() - t_start
    n_tokens = sum(len(s.tokens) - 1 for s in data)
    logger.info("dataset: %d sequences, %d positions (%.0fs)", len(data), n_tokens, t_data)

    history = train_head(head, data, labels, embed_weight=embed, lm_weight=lm, cfg=cfg)
    t_train = time.monotonic() - t_start - t_data

    evals = {
        "chain": dict(num_steps=4, topk=1, num_draft_tokens=5),
        "tree": dict(num_steps=4, topk=4, num_draft_tokens=8),
    }
    accept = {
        name: evaluate_acceptance(runner, head, heldout, max_new=cfg.eval_tokens, stop_ids=stop_ids, **kw)
        for name, kw in evals.items()
    }
    for name, value in accept.items():
        logger.info("held-out accept length (%s %s): %.3f", name, evals[name], value)
    info = {
        "target": source.name,
        "train_sequences": len(data),
        "train_positions": n_tokens,
        "config": vars(cfg),
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
