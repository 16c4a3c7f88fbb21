"""The tensor-parallel shard arithmetic (``models/sharding.py``, ``distributed/slices.py``) and
what each rank's layers hold, built in one process as rank ``r`` of ``N`` (no collectives run)."""

from __future__ import annotations

import pytest
import torch
from phloem.runtime.distributed import state
from phloem.runtime.distributed.slices import vocab_range
from phloem.runtime.distributed.state import TPGroup
from phloem.runtime.executor.dummy import init_dummy_weights
from phloem.runtime.executor.model_runner import ModelRunner
from phloem.runtime.executor.weights_hf import iter_hf_slices
from phloem.runtime.layers.quant import Q4Weight, quantize_model
from phloem.runtime.model_files import ModelSource
from phloem.runtime.models.config import DUMMY_SHAPES, ModelConfig
from phloem.runtime.models.llama import LlamaForCausalLM
from phloem.runtime.models.sharding import HeadShard, head_shard, per_rank_heads

from tests.unit.tp_checkpoints import (
    KV_REPLICATED,
    QWEN2_BIAS,
    QWEN3_QK_NORM,
    full_checkpoint,
    write_hf_folder,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def test_heads_split_evenly_when_the_size_divides_the_kv_heads() -> None:
    assert [head_shard(32, 8, r, 4) for r in range(4)] == [HeadShard(8, 2, 8 * r, 2 * r) for r in range(4)]
    assert head_shard(9, 3, 2, 3) == HeadShard(3, 1, 6, 2)
    assert head_shard(9, 3, 0, 1) == HeadShard(9, 3, 0, 0)


def test_kv_heads_are_replicated_past_their_count() -> None:
    # 8 query heads, 2 KV heads, 4 ranks: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1
    assert [head_shard(8, 2, r, 4) for r in range(4)] == [
        HeadShard(2, 1, 2 * r, r // 2, kv_copies=2) for r in range(4)
    ]
    assert [head_shard(9, 3, r, 9).kv_start for r in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert head_shard(16, 1, 3, 8) == HeadShard(2, 1, 6, 0, kv_copies=8)  # multi-query attention


def test_every_query_head_finds_its_kv_head_on_its_rank() -> None:
    for heads in range(1, 33):
        for kv in (k for k in range(1, heads + 1) if heads % k == 0):
            for size in range(1, 17):
                try:
                    shards = [head_shard(heads, kv, r, size) for r in range(size)]
                except ValueError:
                    continue
                assert sum(s.num_heads for s in shards) == heads
                for s in shards:
                    for h in range(s.q_start, s.q_start + s.num_heads):
                        assert s.kv_start <= h // (heads // kv) < s.kv_start + s.num_kv_heads


@pytest.mark.parametrize(
    ("heads", "kv", "size", "message"),
    [
        (9, 3, 2, "--tp-size 2 does not divide the model's 9 attention heads"),
        (12, 6, 4, "--tp-size 4 does not divide the model's 6 KV heads"),
        (12, 4, 6, "--tp-size 6 is above the model's 4 KV heads and not a multiple of them"),
    ],
)
def test_sizes_that_fit_no_rule_name_the_constraint(heads: int, kv: int, size: int, message: str) -> None:
    with pytest.raises(ValueError) as info:
        head_shard(heads, kv, 0, size)
    assert str(info.value) == message


def test_per_rank_heads_checks_the_mlp_too() -> None:
    cfg = KV_REPLICATED.replace(intermediate_size=130)
    with pytest.raises(
        ValueError, match="^--tp-size 4 does not divide the model's 130 MLP intermediate features$"
    ):
        per_rank_heads(cfg, TPGroup(rank=0, size=4))
    assert per_rank_heads(KV_REPLICATED, TPGroup()) == HeadShard(8, 2, 0, 0)


def test_vocab_ranges_cover_the_padded_vocabulary() -> None:
    assert [vocab_range(250, r, 4) for r in range(4)] == [(0, 63), (63, 126), (126, 189), (189, 252)]
    assert vocab_range(49152, 2, 3) == (32768, 49152)
    assert vocab_range(7, 0, 1) == (0, 7)


# ---- the layers of rank r of N -----------------------------------------------------------------
def build(cfg: ModelConfig, rank: int, size: int, monkeypatch: pytest.MonkeyPatch) -> LlamaForCausalLM:
    """``cfg``'s model as rank ``rank`` of ``size`` would build it (the group only sizes shards)."""
    with monkeypatch.context() as m:
        m.setattr(state, "_TP", TPGroup(rank=rank, size=size))
        return LlamaForCausalLM(cfg)


def expected_shard(cfg: ModelConfig, name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """What rank ``rank`` must hold of checkpoint tensor ``name``, from the rules written out."""
    heads, d = head_shard(cfg.num_heads, cfg.num_kv_heads, rank, size), cfg.head_dim
    q = slice(heads.q_start * d, (heads.q_start + heads.num_heads) * d)
    kv = slice(heads.kv_start * d, (heads.kv_start + heads.num_kv_heads) * d)
    share = cfg.intermediate_size // size
    mlp = slice(rank * share, (rank + 1) * share)
    if "q_proj" in name:
        return full[q]
    if "k_proj" in name or "v_proj" in name:
        return full[kv]
    if "o_proj" in name:
        return full[:, q]
    if "gate_proj" in name or "up_proj" in name:
        return full[mlp]
    if "down_proj" in name:
        return full[:, mlp]
    if "embed_tokens" in name or "lm_head" in name:
        lo, hi = vocab_range(cfg.vocab_size, rank, size)
        rows = full[lo : min(hi, cfg.vocab_size)]
        return torch.cat((rows, torch.zeros(hi - lo - rows.shape[0], full.shape[1])))
    return full  # norms (Qwen3's q/k norms too) are replicated


def rank_checkpoint(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """A rank's parameters under checkpoint names (fused projections split into their parts)."""
    out = {}
    for name, p in model.named_parameters():
        owner, leaf = name.rsplit(".", 1)
        module = model.get_submodule(owner)
        offsets = getattr(module, "offsets", None)
        if offsets is None:
            out[name] = p.detach()
            continue
        for part, (lo, hi) in offsets.items():
            out[f"{owner.rsplit('.', 1)[0]}.{part}_proj.{leaf}"] = p.detach()[lo:hi]
    return out


CASES = [(KV_REPLICATED, 4), (KV_REPLICATED, 2), (QWEN2_BIAS, 2), (QWEN3_QK_NORM, 2)]


@pytest.mark.parametrize(
    ("cfg", "size"), CASES, ids=["kv-replicated-4", "llama-2", "qwen2-bias-2", "qwen3-2"]
)
def test_each_rank_loads_its_slice_of_the_full_checkpoint(
    tmp_path, monkeypatch, cfg: ModelConfig, size: int
) -> None:
    full = full_checkpoint(cfg, seed=3)
    folder = write_hf_folder(str(tmp_path), cfg, full)
    for rank in range(size):
        model = build(cfg, rank, size, monkeypatch)
        model.load_weights(iter_hf_slices(folder))  # lazy: reads only the rank's rows/columns
        held = rank_checkpoint(model)
        if cfg.tie_word_embeddings:
            assert "lm_head.weight" not in held
        assert held.keys() == full.keys()
        for name, tensor in full.items():
            assert torch.equal(held[name], expected_shard(cfg, name, tensor, rank, size)), (rank, name)


@pytest.mark.parametrize(("cfg", "size"), CASES[:2], ids=["kv-replicated-4", "llama-2"])
def test_dummy_weights_are_slices_of_the_one_rank_draw(monkeypatch, cfg: ModelConfig, size: int) -> None:
    whole = build(cfg, 0, 1, monkeypatch)
    init_dummy_weights(whole, seed=5, std=0.3)
    full = rank_checkpoint(whole)
    for rank in range(size):
        model = build(cfg, rank, size, monkeypatch)
        init_dummy_weights(model, seed=5, std=0.3)
        held = rank_checkpoint(model)
        for name, tensor in full.items():
            assert torch.equal(held[name], expected_shard(cfg, name, tensor, rank, size)), (rank, name)


def test_quantized_slices_hold_the_full_tensors_blocks(monkeypatch) -> None:
    cfg = KV_REPLICATED
    full = full_checkpoint(cfg, seed=4)
    linear = [n for n, t in full.items() if t.dim() == 2 and "_proj" in n]
    blocks = {n: tuple(getattr(Q4Weight.from_float(full[n]), k) for k in ("qs", "d", "m")) for n in linear}
    whole = build(cfg, 0, 1, monkeypatch)
    whole.load_weights(full.items())
    quantize_model(whole, "int4", q4_blocks=blocks)
    size = 2
    for rank in range(size):
        model = build(cfg, rank, size, monkeypatch)
        model.load_weights(full.items())
        quantize_model(model, "int4", q4_blocks=blocks)
        for i in range(cfg.num_layers):
            mine, ref = model.model.layers[i].self_attn.o_proj, whole.model.layers[i].self_attn.o_proj
            lo, hi = mine.cols
            assert torch.equal(mine.quant.qs, ref.quant.qs[:, lo // 2 : hi // 2])
            assert torch.equal(mine.quant.d, ref.quant.d[:, lo // 32 : hi // 32])
            gate_up = model.model.layers[i].mlp.gate_up_proj.quant.dequantize()
            full_gate = Q4Weight(*blocks[f"model.layers.{i}.mlp.gate_proj.weight"]).dequantize()
            assert torch.equal(
                gate_up[: cfg.intermediate_size // size], full_gate[rank * 64 : (rank + 1) * 64]
            )


def test_quantization_refuses_a_row_split_off_the_blocks(monkeypatch) -> None:
    cfg = KV_REPLICATED.replace(num_heads=4, num_kv_heads=2)  # o_proj: 64 columns, 16 per rank at 4
    model = build(cfg, 1, 4, monkeypatch)
    init_dummy_weights(model)
    with pytest.raises(ValueError, match=r"^--quantization int8 with --tp-size 4: model\.layers\.0\.self_attn\.o_proj's 64 input features do not split into whole 32-wide blocks per rank$"):  # fmt: skip
        quantize_model(model, "int8")


def test_in_place_updates_are_refused_under_tensor_parallelism(monkeypatch) -> None:
    model = build(KV_REPLICATED, 0, 2, monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(state, "_TP", TPGroup(rank=0, size=2))
        with pytest.raises(KeyError, match="not supported with --tp-size 2"):
            model.checkpoint_target("model.norm.weight")


def test_concurrent_ranks_dequantize_a_gguf_once(tmp_path, monkeypatch) -> None:
    """Ranks that find no cache: one dequantizes and writes it while the others wait on its lock,
    then every rank reads lazy slices of the same tensors one rank loads whole."""
    import threading

    from phloem.runtime.executor import weights_gguf
    from phloem.runtime.model_files import resolve_model

    path = resolve_model(None).path
    _, whole = weights_gguf.load_gguf_weights(path)  # the usual cache
    monkeypatch.setenv("PHLOEM_CACHE_DIR", str(tmp_path))  # none here yet
    runs, real = [], weights_gguf._dequantize_all

    def counted(*args):
        runs.append(1)
        yield from real(*args)

    monkeypatch.setattr(weights_gguf, "_dequantize_all", counted)
    got: list[dict] = []
    threads = [
        threading.Thread(target=lambda: got.append(weights_gguf.load_gguf_slices(path))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(runs) == 1 and len(got) == 3
    name = "model.layers.3.self_attn.k_proj.weight"
    for slices in got:
        assert slices.keys() == whole.keys()
        assert tuple(slices[name].get_shape()) == tuple(whole[name].shape)
        assert torch.equal(slices[name][64:128], whole[name][64:128])
        assert torch.equal(
            slices["model.layers.0.mlp.down_proj.weight"][:, 512:],
            whole["model.layers.0.mlp.down_proj.weight"][:, 512:],
        )
    assert weights_gguf.gguf_config(path) == weights_gguf.load_gguf_weights(path)[0]


def test_runner_sizes_its_pool_and_attention_by_the_ranks_heads(monkeypatch) -> None:
    monkeypatch.setitem(DUMMY_SHAPES, "tp-test-kv-replicated", KV_REPLICATED)

    def runner(rank: int, size: int) -> ModelRunner:
        with monkeypatch.context() as m:
            m.setattr(state, "_TP", TPGroup(rank=rank, size=size))
            return ModelRunner(ModelSource("dummy", "tp-test-kv-replicated"), dtype="float32", device="cpu",
                               max_total_tokens=256, cpu_threads=1)  # fmt: skip

    one, ranks = runner(0, 1), [runner(r, 4) for r in range(4)]
    for rank, r in enumerate(ranks):
        assert r.heads == head_shard(8, 2, rank, 4)
        assert (r.kv_pool.num_kv_heads, r.attn_backend.num_heads) == (1, 2)
        assert r.kv_pool.bytes_per_token * 2 == one.kv_pool.bytes_per_token
    # split weights add up to one rank's, plus: the norms sit on every rank, each KV head's k/v rows
    # on two, and the vocabulary pads 250 -> 252 rows
    norms = sum(p.numel() * 4 for name, p in one.model.named_parameters() if "norm" in name)
    kv_rows = KV_REPLICATED.num_layers * 2 * (2 * 16) * 64 * 4
    assert sum(r.weight_bytes for r in ranks) == one.weight_bytes + 3 * norms + kv_rows + 2 * 64 * 4
    assert all(r.decode_weight_bytes == r.weight_bytes for r in ranks)  # the tied head reads every row


def test_a_rank_reads_only_its_q4_blocks_from_the_gguf(monkeypatch) -> None:
    """The default model's Q4_1 blocks read lazily for rank r of 3 (Q/K rows of whole heads, the
    o/down columns of whole blocks) equal the whole tensors' blocks cut to the rank's slice."""
    from phloem.runtime.executor.weights_gguf import gguf_config, load_gguf_q4_blocks, load_gguf_slices
    from phloem.runtime.model_files import resolve_model

    path = resolve_model(None).path
    cfg = gguf_config(path)
    whole, lazy = load_gguf_q4_blocks(path, cfg), load_gguf_q4_blocks(path, cfg, lazy=True)
    assert whole.keys() == lazy.keys()
    for rank in (0, 2):
        models = []
        for blocks in (whole, lazy):
            model = build(cfg.replace(num_layers=2), rank, 3, monkeypatch)
            weights = {
                k: v
                for k, v in load_gguf_slices(path).items()
                if ".layers." not in k or ".layers.0." in k or ".layers.1." in k
            }
            model.load_weights(weights.items())
            quantize_model(model, "int4", q4_blocks=blocks)
            models.append(model)
        for (name, a), b in zip(models[0].named_buffers(), models[1].buffers()):
            assert torch.equal(a, b), (rank, name)


def test_column_then_row_parallel_slices_sum_to_the_full_product(monkeypatch) -> None:
    """Rank r's column slice of ``W1`` then row slice of ``W2``: the ranks' partial products add up to
    ``x @ W1.T @ W2.T`` (the sum the all-reduce takes), plus the bias once."""
    from phloem.runtime.layers.linear import ColumnParallelLinear, RowParallelLinear

    gen = torch.Generator().manual_seed(0)
    w1, w2, bias, x = (torch.randn(s, generator=gen) for s in ((12, 8), (5, 12), (5,), (3, 8)))
    partial = []
    for rank in range(3):
        with monkeypatch.context() as m:
            m.setattr(state, "_TP", TPGroup(rank=rank, size=3))
            col, row = ColumnParallelLinear(8, 12), RowParallelLinear(12, 5, bias=True)
        assert (col.rows, row.cols, col.full_shape("weight"), row.full_shape("weight")) == (
            (4 * rank, 4 * rank + 4), (4 * rank, 4 * rank + 4), (12, 8), (5, 12)
        )  # fmt: skip
        with torch.no_grad():
            col.weight.copy_(col.shard_of("weight", w1))
            row.weight.copy_(row.shard_of("weight", w2))
            row.bias.copy_(row.shard_of("bias", bias))
            partial.append(row._project(col(x), None))
    torch.testing.assert_close(sum(partial) + bias, x @ w1.T @ w2.T + bias)
