"""In-place weight updates of a loaded model (``ModelRunner.update_weights_from_*``): names and
shapes are checked before anything is written, a refusal changes nothing, and the model keeps its
tensors (same objects, same storage) so captured CUDA graphs stay valid."""

from __future__ import annotations

import json
import os

import pytest
import torch
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.executor.weight_update import (
    check_load_format,
    check_same_architecture,
    model_tensors,
    plan_full_copy,
    read_safetensors_bytes,
)
from phloem.runtime.layers.linear import MergedLinear
from phloem.runtime.model_files import ModelSource
from phloem.runtime.models.config import ModelConfig

from tests.unit.tiny_model import tiny_runner

PROMPT = [5, 17, 42, 99, 3, 250]


def hf_checkpoint(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights under Hugging Face names (fused projections split into their parts)."""
    out = {}
    for name, p in model.named_parameters():
        owner, which = name.rsplit(".", 1)
        module = model.get_submodule(owner)
        if isinstance(module, MergedLinear):
            prefix = owner.rsplit(".", 1)[0]
            for part, (lo, hi) in module.offsets.items():
                out[f"{prefix}.{part}_proj.{which}"] = p.detach()[lo:hi].clone()
        else:
            out[name] = p.detach().clone()
    return out


def write_hf_folder(folder: str, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> str:
    """A Hugging Face model folder (config.json + model.safetensors) the loader accepts."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.context_len,
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    return folder


def snapshot(runner: ModelRunner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model_tensors(runner.model).items()}


def assert_unchanged(runner: ModelRunner, before: dict[str, torch.Tensor]) -> None:
    now = model_tensors(runner.model)
    assert now.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(now[name], value), name


def greedy(runner: ModelRunner) -> list[int]:
    return DirectBatcher(runner).generate_greedy(PROMPT, 8)


@pytest.fixture(scope="module")
def other_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with other random weights (seed 2), as a Hugging Face folder."""
    other = tiny_runner(seed=2)
    return write_hf_folder(str(tmp_path_factory.mktemp("other")), other.model_config, hf_checkpoint(other.model))


def test_disk_update_copies_into_the_same_tensors(other_folder: str):
    runner, reference = tiny_runner(seed=1), tiny_runner(seed=2)
    before = greedy(runner)
    tensors = model_tensors(runner.model)
    identity = {name: (id(t), t.data_ptr()) for name, t in tensors.items()}
    message = runner.update_weights_from_disk(other_folder)
    assert other_folder in message and runner.model_source == ModelSource("safetensors", other_folder)
    after = model_tensors(runner.model)
    assert {name: (id(t), t.data_ptr()) for name, t in after.items()} == identity
    for name, value in model_tensors(reference.model).items():
        assert torch.equal(after[name], value), name
    assert greedy(runner) == greedy(reference) != before


def test_disk_update_refusals_change_nothing(tmp_path, other_folder: str):
    runner = tiny_runner(seed=1)
    before = snapshot(runner)
    good = hf_checkpoint(tiny_runner(seed=2).model)
    cfg = runner.model_config
    wrong_shape = {**good, "model.layers.1.mlp.down_proj.weight": torch.zeros(64, 100)}
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    cases = {
        "shape": write_hf_folder(str(tmp_path / "shape"), cfg, wrong_shape),
        "missing tensors": write_hf_folder(str(tmp_path / "missing"), cfg, missing),
        "different architecture": write_hf_folder(str(tmp_path / "arch"), cfg.replace(num_layers=3), good),
        "no such path": str(tmp_path / "nowhere"),
    }
    for why, folder in cases.items():
        with pytest.raises(InvalidRequest) as info:
            runner.update_weights_from_disk(folder)
        assert info.value.field == "model_path", why
        assert_unchanged(runner, before)
    with pytest.raises(InvalidRequest, match="num_layers"):
        runner.update_weights_from_disk(cases["different architecture"])
    with pytest.raises(InvalidRequest) as info:
        runner.update_weights_from_disk(other_folder, load_format="pt")
    assert info.value.field == "load_format"
    assert_unchanged(runner, before)


def test_load_format_values():
    assert check_load_format(None) == "auto"
    for value in ("auto", "gguf", "safetensors"):
        assert check_load_format(value) == value
    for value in ("dummy", "pt", "bitsandbytes", ""):
        with pytest.raises(InvalidRequest) as info:
            check_load_format(value)
        assert info.value.field == "load_format" and repr(value) in info.value.message


def test_architecture_check_tolerates_float32_rounding_only():
    cfg = ModelConfig.dummy("tiny-llama")
    check_same_architecture(cfg, cfg.replace(rms_norm_eps=float(torch.tensor(cfg.rms_norm_eps))))
    check_same_architecture(cfg, cfg.replace(context_len=99))  # the runner keeps its own
    with pytest.raises(InvalidRequest, match="hidden_size"):
        check_same_architecture(cfg, cfg.replace(hidden_size=128, intermediate_size=256))
    with pytest.raises(InvalidRequest, match="rope_theta"):
        check_same_architecture(cfg, cfg.replace(rope_theta=20000.0))
    llama3 = ModelConfig.dummy("llama3-8b")
    assert llama3.rope_scaling is not None
    as_hf = {**llama3.rope_scaling, "type": "llama3"}  # keys the rotary embedding does not read
    check_same_architecture(llama3, llama3.replace(rope_scaling=as_hf))
    with pytest.raises(InvalidRequest, match="rope_scaling"):
        check_same_architecture(llama3, llama3.replace(rope_scaling={**as_hf, "factor": 4.0}))
    with pytest.raises(InvalidRequest, match="rope_scaling"):
        check_same_architecture(llama3, llama3.replace(rope_scaling=None))


def test_full_copy_plan_checks_names_and_shapes():
    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    plan = plan_full_copy({"w": a}, {"w": b}, "model_path")
    plan.apply()
    assert torch.equal(a, b)
    with pytest.raises(InvalidRequest, match="extra"):
        plan_full_copy({"w": a}, {"w": b, "v": b}, "model_path")
    with pytest.raises(InvalidRequest, match="shape"):
        plan_full_copy({"w": a}, {"w": torch.ones(3, 2)}, "model_path")


def test_named_update_of_a_subset_lands_in_place():
    runner, reference = tiny_runner(seed=1), tiny_runner(seed=2)
    subset = {
        k: v
        for k, v in hf_checkpoint(reference.model).items()
        if k.startswith("model.layers.0.") or k == "model.embed_tokens.weight"
    }
    assert "model.layers.0.self_attn.k_proj.weight" in subset  # a part of a fused projection
    qkv = runner.model.get_submodule("model.layers.0.self_attn.qkv_proj").weight
    ptr = qkv.data_ptr()
    assert runner.update_weights_from_tensors(subset) == f"updated {len(subset)} tensors"
    assert qkv.data_ptr() == ptr
    lo, hi = runner.model.get_submodule("model.layers.0.self_attn.qkv_proj").offsets["k"]
    assert torch.equal(qkv[lo:hi], subset["model.layers.0.self_attn.k_proj.weight"])
    layer1 = "model.layers.1.mlp.down_proj.weight"
    assert not torch.equal(model_tensors(runner.model)[layer1], model_tensors(reference.model)[layer1])


def test_named_update_is_all_or_nothing():
    runner = tiny_runner(seed=1)
    before = snapshot(runner)
    good = {"model.norm.weight": torch.full((64,), 3.0)}  # valid, listed first
    bad_cases = {
        "unknown name": {**good, "model.layers.7.mlp.up_proj.weight": torch.zeros(128, 64)},
        "shape": {**good, "model.layers.0.self_attn.v_proj.weight": torch.zeros(16, 64)},
        "tied head": {**good, "lm_head.weight": torch.zeros(512, 64)},
        "integer data": {**good, "model.layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.int64)},
        "nothing": {},
    }
    for why, tensors in bad_cases.items():
        with pytest.raises(InvalidRequest) as info:
            runner.update_weights_from_tensors(tensors, "safetensors_b64")
        assert info.value.field == "safetensors_b64", why
        assert_unchanged(runner, before)
    with pytest.raises(InvalidRequest, match="layers.7"):
        runner.update_weights_from_tensors(bad_cases["unknown name"])


def test_safetensors_bytes_are_parsed_without_code():
    from safetensors.torch import save

    data = save({"a": torch.arange(4.0)})
    assert torch.equal(read_safetensors_bytes(data, "safetensors_b64")["a"], torch.arange(4.0))
    import pickle

    with pytest.raises(InvalidRequest) as info:
        read_safetensors_bytes(pickle.dumps({"a": 1}), "safetensors_b64")
    assert info.value.field == "safetensors_b64"


def test_quantized_model_requantizes_from_disk_and_refuses_named_layers(other_folder: str):
    runner = ModelRunner(
        ModelSource("dummy", "tiny-llama"), dtype="float32", device="cpu", max_total_tokens=256, quantization="int8"
    )
    proj = runner.model.get_submodule("model.layers.0.mlp.down_proj")
    qs = proj.quant.qs
    runner.update_weights_from_disk(other_folder)
    assert proj.quant.qs is qs  # the quantized blocks were rewritten in place
    from phloem.runtime.layers.quant import Q8Weight

    expected = Q8Weight.from_float(hf_checkpoint(tiny_runner(seed=2).model)["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(qs, expected.qs) and torch.equal(proj.quant.d, expected.d)
    before = snapshot(runner)
    for name, shape in [
        ("model.layers.0.mlp.down_proj.weight", (64, 128)),
        ("model.layers.0.self_attn.q_proj.weight", (64, 64)),
        ("model.embed_tokens.weight", (512, 64)),  # the quantized LM head keeps its own copy
    ]:
        with pytest.raises(InvalidRequest, match="quantized") as info:
            runner.update_weights_from_tensors({name: torch.zeros(shape)}, "tensor_file")
        assert name in info.value.message
    runner.update_weights_from_tensors({"model.norm.weight": torch.ones(64)})  # float tensors still update
    before["model.norm.weight"] = torch.ones(64)
    assert_unchanged(runner, before)
