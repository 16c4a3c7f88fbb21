"""Draft-head training: the ``--tiny`` smoke run end to end on a random tiny target, the recorded
data against a one-sequence-at-a-time reference, the unrolled training passes against depth-k
drafting, the loss masking, the prompt mix, and the shipped head's metadata."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from phloem.runtime.cache.allocator import TokenSlotAllocator
from phloem.runtime.speculative import DEFAULT_EAGLE_HEAD
from phloem.runtime.speculative.decoding import target_forward
from phloem.runtime.speculative.eagle import EagleConfig, EagleHead, load_eagle_head
from phloem.training.eagle_head import (
    DEFAULT_PROMPTS,
    TrainConfig,
    TrainingData,
    _batch_loss,
    _gather,
    answer_and_record,
    choose_draft_vocab,
    read_prompts,
    train_eagle_main,
    unroll_mask,
    unrolled_features,
)

from tests.unit.tiny_model import tiny_runner


def test_tiny_training_run(tmp_path):
    torch.set_num_threads(1)
    out = str(tmp_path / "head.safetensors")
    rc = train_eagle_main(["--target", "tiny-llama", "--load-format", "dummy", "--out", out, "--tiny"])
    assert rc == 0 and os.path.getsize(out) > 0
    head = load_eagle_head(out)
    assert head.cfg.hidden_size == 64 and head.token_map.numel() == head.cfg.draft_vocab_size
    from safetensors import safe_open

    with safe_open(out, framework="pt") as f:
        info = json.loads(f.metadata()["info"])
    assert set(info["heldout_accept_length"]) == {"chain", "tree", "tree-16"}
    assert all(v >= 1.0 for v in info["heldout_accept_length"].values())


def test_draft_vocab_prefers_frequent_labels_then_low_ids():
    labels = [torch.tensor([9, 9, 9, 7, 7, 5])]
    assert choose_draft_vocab(labels, 10, 4).tolist() == [0, 5, 7, 9]
    assert choose_draft_vocab(labels, 10, 20).tolist() == list(range(10))


def test_prompt_file_is_varied():
    prompts = read_prompts(DEFAULT_PROMPTS)
    assert len(prompts) >= 200 and len(set(prompts)) == len(prompts)


def test_mixed_prompts_are_distinct_seeded_and_avoid_the_heldout_set():
    from phloem.training.prompt_mix import mixed_prompts

    a = mixed_prompts(2000, seed=0)
    assert len(a) == len(set(a)) == 2000
    assert mixed_prompts(2000, seed=0) == a and mixed_prompts(2000, seed=1) != a
    assert not set(a) & set(read_prompts(DEFAULT_PROMPTS)[:12])


def test_mixed_prompts_reach_thousands_across_families():
    from phloem.training.prompt_mix import mixed_prompts, prompt_families

    a = mixed_prompts(6000, seed=0)
    assert len(set(a)) == 6000
    assert not set(a) & set(read_prompts(DEFAULT_PROMPTS))  # nothing the prompt file already has
    for topic in ("fibonacci", "photosynthesis", "water cycle", "sleep", "bicycle", "tuple", "bakery"):
        assert not any(topic in p.lower() for p in a), topic  # the held-out prompts' topics
    chosen = set(a)
    for name, (_, prompts) in prompt_families(0).items():
        assert len(chosen.intersection(prompts)) >= 100, name
    assert sum("\n" in p for p in a) >= 300  # texts to rewrite and code to read


def test_cli_tiny_training_run_with_mixed_prompts(tmp_path):
    torch.set_num_threads(1)
    out = str(tmp_path / "head.safetensors")
    from phloem.cli import main

    argv = ["--target", "tiny-llama", "--load-format", "dummy", "--out", out, "--tiny", "--mixed-prompts", "6"]
    assert main(["train-eagle", *argv]) == 0  # through the command line, flags first
    from safetensors import safe_open

    with safe_open(out, framework="pt") as f:
        info = json.loads(f.metadata()["info"])
    assert info["train_sequences"] == 8 + 6  # --tiny keeps 8 hand-written prompts; the mix adds 6


@pytest.mark.skipif(not os.path.exists(DEFAULT_EAGLE_HEAD), reason="shipped head missing")
def test_shipped_head_fits_the_default_model_shape():
    assert os.path.getsize(DEFAULT_EAGLE_HEAD) < 10 * 2**20
    head = load_eagle_head(DEFAULT_EAGLE_HEAD)
    c = head.cfg
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (576, 9, 3, 64, 49152)
    assert head.token_map.min() >= 0 and head.token_map.max() < c.vocab_size


# ---------------------------------------------------------------------------------- recorded data
def _reference_record(runner, prompt: list[int], max_new: int, stop_ids: set[int]):
    """One sequence, one token at a time: tokens, features and argmax labels of every position."""
    pool = runner.req_to_token_pool
    alloc = TokenSlotAllocator(runner.kv_pool.num_slots)
    row = pool.alloc()
    try:
        logits, hidden = target_forward(runner, [row], [prompt], [alloc.alloc(len(prompt))])
        tokens, feats = [*prompt], [hidden[0]]
        while True:
            tokens.append(int(logits.argmax(-1)))
            if tokens[-1] in stop_ids or len(tokens) - len(prompt) == max_new:
                break
            logits, hidden = target_forward(
                runner, [row], [[tokens[-1]]], [alloc.alloc(1)], prefix_lens=[len(tokens) - 1]
            )
            feats.append(hidden[0])
    finally:
        pool.free(row)
    f = torch.cat(feats)
    return tokens, f, runner.model.compute_logits(f).argmax(-1)


@torch.inference_mode()
def test_recorded_answers_match_one_sequence_at_a_time():
    torch.set_num_threads(1)
    runner = tiny_runner(max_running_requests=8)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 11, 3, 8)]
    free = [_reference_record(runner, p, 9, set()) for p in prompts]
    stop = free[1][0][len(prompts[1]) + 3]  # sequence 1 stops at its 4th answer token (or earlier)
    refs = [_reference_record(runner, p, 9, {stop}) for p in prompts]
    alloc = TokenSlotAllocator(runner.kv_pool.num_slots)
    ans = answer_and_record(runner, prompts, 9, allocator=alloc, stop_ids={stop})
    assert alloc.available_size == alloc.total_size  # every slot handed back
    assert ans.lengths == [len(t) - 1 for t, _, _ in refs] and ans.lengths[1] <= len(prompts[1]) + 3
    rows = torch.cumsum(torch.tensor([0, *ans.lengths]), 0).tolist()
    for prompt, (tokens, feats, labels), a, b in zip(prompts, refs, rows, rows[1:]):
        assert ans.tokens[a:b].tolist() == tokens[:-1]
        torch.testing.assert_close(ans.features[a:b], feats, atol=1e-4, rtol=1e-4)
        assert ans.labels[a:b].tolist() == labels.tolist()
        # greedy: from the last prompt position on, each label is the answer token that follows
        assert ans.labels[a:b].tolist()[len(prompt) - 1 :] == tokens[len(prompt) :]


# ---------------------------------------------------------------------------------- unrolled passes
def _random_head(seed: int = 0) -> EagleHead:
    cfg = EagleConfig(hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8,
                      vocab_size=40, draft_vocab_size=40)  # fmt: skip
    head = EagleHead(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return head.eval()


def test_unroll_mask_table():
    # pass 3 over 5 positions: committed keys (pass 1) up to j - 2, then pass 2 at j - 1, pass 3 at j
    m = unroll_mask(5, 3).int()
    assert m[4].tolist() == [1, 1, 1, 0, 0] + [0, 0, 0, 1, 0] + [0, 0, 0, 0, 1]
    assert m[2].tolist() == [1, 0, 0, 0, 0] + [0, 1, 0, 0, 0] + [0, 0, 1, 0, 0]
    assert torch.equal(unroll_mask(4, 1), torch.ones(4, 4, dtype=torch.bool).tril())


@torch.no_grad()
@pytest.mark.parametrize("unroll", [2, 3])
def test_unrolled_pass_k_is_a_depth_k_draft_step(unroll):
    """Pass k at position j equals running the head causally over the committed inputs up to
    n = j - k + 1 followed by the draft chain n + 1 .. j, each fed its parent's predicted feature."""
    head = _random_head()
    gen = torch.Generator().manual_seed(1)
    n_pos = 7
    emb, feat = torch.randn(2, 1, n_pos, 32, generator=gen)
    outs = unrolled_features(head, emb, feat, unroll)
    torch.testing.assert_close(outs[0], head.forward_dense(emb, feat))
    k = unroll
    for j in range(k - 1, n_pos):
        n = j - k + 1
        chain = [outs[m - 1][0, n + m - 1] for m in range(1, k)]  # inputs of positions n+1 .. j
        inputs = torch.cat([feat[0, : n + 1], torch.stack(chain)])[None]
        expect = head.forward_dense(emb[:, : j + 1], inputs)[0, -1]
        torch.testing.assert_close(outs[k - 1][0, j], expect, atol=1e-5, rtol=1e-5)


def _flat_data(
    seqs: list[torch.Tensor], labels: list[torch.Tensor], prompt_lens: list[int] | None = None
) -> TrainingData:
    """``seqs[s]`` ``[L, H]`` features (token = position index) as :class:`TrainingData`; no
    prompt positions unless ``prompt_lens`` says so."""
    lengths = [f.shape[0] for f in seqs]
    feats = torch.cat([*seqs, torch.zeros(1, seqs[0].shape[1])])
    tokens = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(1, dtype=torch.int64)])
    starts = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0).tolist()
    return TrainingData(tokens, feats, torch.cat([*labels, torch.tensor([-100])]), starts, lengths,
                        list(range(len(seqs))), prompt_lens or [0] * len(seqs))  # fmt: skip


@torch.no_grad()
def test_unroll_loss_with_an_identity_head_shifts_the_inputs_and_masks_padding():
    """A head whose output equals its feature input predicts f_{j-1} at pass 1 and f_{j-2} at pass
    2; padded positions and pass-2 position 0 count nowhere."""
    h, vocab = 32, 40
    head = _random_head()
    head.fc.weight.zero_()
    head.fc.weight[:, h:] = torch.eye(h)
    head.fc.bias.zero_()
    head.o_proj.weight.zero_()
    head.down_proj.weight.zero_()
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randn(n, h, generator=gen) for n in (6, 3)]
    labels = [torch.randint(0, vocab, (n,), generator=gen) for n in (6, 3)]
    labels[1][2] = 39  # outside the draft vocabulary: feature loss only
    data = _flat_data(seqs, labels)
    to_draft = torch.cat([torch.arange(39), torch.tensor([-100])])
    draft_lm = torch.randn(39, h, generator=gen)
    embed = torch.randn(vocab, h, generator=gen)
    cfg = TrainConfig(unroll=2, unroll_weight=0.5, reg_weight=1.0, cls_weight=0.3, feature_noise=0.0)
    batch = _gather(data, [0, 1], to_draft, torch.device("cpu"))
    loss, hits, counts = _batch_loss(head, batch, embed_weight=embed, draft_lm=draft_lm, cfg=cfg, noise=None)

    def expected(shift: int) -> tuple[float, float, int]:
        pred, true, lab = [], [], []
        for f, y in zip(seqs, labels):
            padded = torch.cat([torch.zeros(shift, h), f])
            pred.append(padded[: len(f)][shift - 1 :])  # pass `shift` counts from position shift - 1
            true.append(f[shift - 1 :])
            lab.append(to_draft[y][shift - 1 :])
        p, t, y = torch.cat(pred), torch.cat(true), torch.cat(lab)
        ce = F.cross_entropy(F.linear(p, draft_lm), y, ignore_index=-100)
        return float(F.smooth_l1_loss(p, t)), float(ce), int((y >= 0).sum())

    (r1, c1, n1), (r2, c2, n2) = expected(1), expected(2)
    assert counts.tolist() == [n1, n2] == [8, 6]
    assert float(loss) == pytest.approx(r1 + 0.3 * c1 + 0.5 * (r2 + 0.3 * c2), rel=1e-5)
    assert hits.shape == (2,)
    cfg1 = TrainConfig(unroll=1, cls_weight=0.3, feature_noise=0.0)
    loss1, _, counts1 = _batch_loss(head, batch, embed_weight=embed, draft_lm=draft_lm, cfg=cfg1, noise=None)
    assert float(loss1) == pytest.approx(r1 + 0.3 * c1, rel=1e-5) and counts1.tolist() == [8]


@torch.no_grad()
def test_prompt_positions_are_down_weighted_and_never_scored():
    """With prompt lengths (2, 1) and ``prompt_weight`` w, pass 1's feature and label losses are
    means weighted w at prompt positions and 1 in the answer; hits and counts cover the answer."""
    h, vocab, w = 32, 40, 0.25
    head = _random_head(3)
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randn(n, h, generator=gen) for n in (5, 4)]
    labels = [torch.randint(0, vocab, (n,), generator=gen) for n in (5, 4)]
    data = _flat_data(seqs, labels, prompt_lens=[2, 1])
    to_draft = torch.arange(vocab)
    draft_lm = torch.randn(vocab, h, generator=gen)
    embed = torch.randn(vocab, h, generator=gen)
    cfg = TrainConfig(unroll=1, reg_weight=1.0, cls_weight=0.5, feature_noise=0.0, prompt_weight=w)
    batch = _gather(data, [0, 1], to_draft, torch.device("cpu"))
    loss, hits, counts = _batch_loss(head, batch, embed_weight=embed, draft_lm=draft_lm, cfg=cfg, noise=None)

    reg, ce, weights, hit = [], [], [], 0
    for f, y, plen in zip(seqs, labels, [2, 1]):
        feat_in = torch.cat([torch.zeros(1, h), f[:-1]])
        g = head.forward_dense(F.embedding(torch.arange(len(f)), embed)[None], feat_in[None])[0]
        logits = F.linear(g, draft_lm)
        reg.append(F.smooth_l1_loss(g, f, reduction="none").mean(-1))
        ce.append(F.cross_entropy(logits, y, reduction="none"))
        weights.append(torch.tensor([w if j < plen else 1.0 for j in range(len(f))]))
        hit += int((logits.argmax(-1) == y)[plen:].sum())
    r, c, wt = torch.cat(reg), torch.cat(ce), torch.cat(weights)
    expect = float((r * wt).sum() / wt.sum() + 0.5 * (c * wt).sum() / wt.sum())
    assert float(loss) == pytest.approx(expect, rel=1e-5)
    assert counts.tolist() == [(5 - 2) + (4 - 1)] and hits.tolist() == [hit]
