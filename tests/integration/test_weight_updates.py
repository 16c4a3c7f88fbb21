"""Weight updates on the real default model, over HTTP and through the Engine.

A second checkpoint of the same architecture is the default model with a few tensors perturbed
(layer 0's attention and MLP, the final norm), written as a Hugging Face folder. A server started
on it gives the reference output of the new weights; the shared ``engine`` gives the original's.
Each update must reproduce the reference exactly (float32 on the CPU, identical tensors), and
each refused update must leave the output as it was.
"""

from __future__ import annotations

import base64
import threading
import time
from types import SimpleNamespace

import pytest
import requests
import torch

from tests.unit.test_weight_update import write_hf_folder

from .conftest import ServerProcess

PROMPT = "The three primary colors are"
MAX_NEW = 16
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "input_layernorm")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def engine(float_engine):
    """Exact float32 weights: these tests write projection weights and compare with a float32 server."""
    return float_engine


def perturbed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """New values for layer 0 and the final norm: each tensor plus seeded noise of half its spread."""
    gen = torch.Generator().manual_seed(1234)
    names = [f"model.layers.0.{part}.weight" for part in ATTENTION + MLP] + ["model.norm.weight"]
    out = {}
    for name in names:
        w = weights[name]
        out[name] = (w + 0.5 * w.std() * torch.randn(w.shape, generator=gen)).contiguous()
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    from phloem.runtime.executor.weights_gguf import load_gguf_weights
    from phloem.runtime.model_files import default_model_path
    from safetensors.torch import save_file

    gguf = default_model_path()
    cfg, weights = load_gguf_weights(gguf)
    subset = perturbed(weights)
    root = tmp_path_factory.mktemp("weights")
    folder = write_hf_folder(str(root / "perturbed"), cfg, {**weights, **subset})
    mlp_file = str(root / "mlp.safetensors")
    save_file({k: v for k, v in subset.items() if ".mlp." in k}, mlp_file)
    # refused checkpoints: another shape of the family, and the right config with a misshapen tensor
    small = cfg.replace(num_layers=2)
    other_arch = write_hf_folder(str(root / "other_arch"), small, {"model.norm.weight": torch.ones(cfg.hidden_size)})
    bad_shape = write_hf_folder(str(root / "bad_shape"), cfg, {**weights, "model.norm.weight": torch.ones(7)})
    return SimpleNamespace(
        gguf=gguf, folder=folder, subset=subset, mlp_file=mlp_file, other_arch=other_arch, bad_shape=bad_shape
    )


@pytest.fixture(scope="module")
def new_server(ckpt: SimpleNamespace):
    """A server started on the perturbed folder (with the default model's tokenizer)."""
    srv = ServerProcess("--model-path", ckpt.folder, "--tokenizer-path", ckpt.gguf)
    srv.wait_ready()
    srv.start_output = server_greedy(srv)  # the reference output of the new weights
    yield srv
    srv.stop()


def post(srv: ServerProcess, path: str, body: dict) -> requests.Response:
    return requests.post(srv.url + path, json=body, timeout=600)


def server_greedy(srv: ServerProcess) -> list[int]:
    requests.post(srv.url + "/flush_cache", timeout=30)  # every run is a fresh prefill
    r = post(srv, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def engine_greedy(engine) -> list[int]:
    engine.flush_cache()
    out = engine.generate(PROMPT, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
    return out["output_ids"]


def b64(tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save

    return base64.b64encode(save(tensors)).decode()


def assert_refused(r: requests.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["success"] is False and body["error"]["param"] == param and param in body["message"]


def test_http_updates_from_disk_and_tensors(new_server, engine, ckpt):
    srv = new_server
    original = engine_greedy(engine)
    assert srv.start_output != original  # the perturbation changes the greedy output

    r = post(srv, "/update_weights_from_disk", {"model_path": ckpt.gguf})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert server_greedy(srv) == original
    assert requests.get(srv.url + "/get_model_info", timeout=10).json()["model_path"] == ckpt.gguf

    # refusals name the field and leave the weights as they are
    assert_refused(post(srv, "/update_weights_from_disk", {"model_path": ckpt.folder + "-missing"}), "model_path")
    assert_refused(post(srv, "/update_weights_from_disk", {"model_path": ckpt.folder, "load_format": "pt"}), "load_format")
    r = post(srv, "/update_weights_from_disk", {"model_path": ckpt.other_arch})
    assert_refused(r, "model_path")
    assert "num_layers" in r.json()["message"]
    assert_refused(post(srv, "/update_weights_from_disk", {"model_path": ckpt.bad_shape}), "model_path")
    attention = {k: v for k, v in ckpt.subset.items() if ".mlp." not in k}
    for bad in (
        {**attention, "model.layers.0.self_attn.nope.weight": torch.zeros(3)},  # unknown name
        {**attention, "model.norm.weight": torch.ones(7)},  # shape mismatch
    ):
        assert_refused(post(srv, "/update_weights_from_tensor", {"safetensors_b64": b64(bad)}), "safetensors_b64")
    pickled = base64.b64encode(b"\x80\x04\x95pickle").decode()
    assert_refused(post(srv, "/update_weights_from_tensor", {"safetensors_b64": pickled}), "safetensors_b64")
    assert_refused(post(srv, "/update_weights_from_tensor", {"tensor_file": "/no/such.safetensors"}), "tensor_file")
    assert server_greedy(srv) == original

    # the tensor route in two parts: inline bytes for the attention, a file for the MLP
    r = post(srv, "/update_weights_from_tensor", {"safetensors_b64": b64(attention)})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    r = post(srv, "/update_weights_from_tensor", {"tensor_file": ckpt.mlp_file})
    assert r.status_code == 200, r.text
    assert server_greedy(srv) == srv.start_output

    r = post(srv, "/update_weights_from_disk", {"model_path": ckpt.folder})
    assert r.status_code == 200, r.text
    assert server_greedy(srv) == srv.start_output
    assert requests.get(srv.url + "/get_model_info", timeout=10).json()["model_path"] == ckpt.folder


def test_http_update_waits_for_running_requests_or_aborts_them(new_server, ckpt):
    srv = new_server
    for abort, max_new in ((False, 48), (True, 4000)):
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
        result: dict = {}
        worker = threading.Thread(target=lambda out=result, b=body: out.update(r=post(srv, "/generate", b)))
        worker.start()
        deadline = time.time() + 60
        while requests.get(srv.url + "/get_server_info", timeout=10).json()["live"]["num_running_reqs"] == 0:
            assert time.time() < deadline
            time.sleep(0.05)
        r = post(srv, "/update_weights_from_disk", {"model_path": ckpt.folder, "abort_all_requests": abort})
        worker.join(timeout=600)
        assert r.status_code == 200, r.text
        out = result["r"]
        if abort:  # aborted, and told to come back later
            assert out.status_code == 503 and "weights are being updated" in out.json()["error"]["message"]
        else:  # finished on the old weights, not dropped
            assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == max_new
    assert server_greedy(srv) == srv.start_output


def test_engine_updates_from_disk_and_tensors(new_server, engine, ckpt):
    original = engine_greedy(engine)
    try:
        ok, message = engine.update_weights_from_disk(ckpt.folder)
        assert ok, message
        assert engine_greedy(engine) == new_server.start_output
        assert engine.get_model_info()["model_path"] == ckpt.folder

        ok, message = engine.update_weights_from_disk(ckpt.gguf)
        assert ok and engine_greedy(engine) == original

        ok, message = engine.update_weights_from_tensor({"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)})
        assert not ok and "named_tensors" in message and "shape" in message
        ok, message = engine.update_weights_from_disk(ckpt.other_arch)
        assert not ok and message.startswith("model_path:")
        assert engine_greedy(engine) == original

        ok, message = engine.update_weights_from_tensor(ckpt.subset)
        assert ok, message
        assert engine_greedy(engine) == new_server.start_output
    finally:
        ok, message = engine.update_weights_from_disk(ckpt.gguf)  # the shared engine goes back as it was
    assert ok and engine_greedy(engine) == original
    assert engine.get_model_info()["model_path"] == ckpt.gguf



def test_engine_reads_weights_and_takes_broadcast_updates(engine, ckpt):
    """The Engine's side of a trainer sync: join over gloo, receive while the trainer (a thread
    here) broadcasts, read the values back by name; then the originals go back."""
    from concurrent.futures import ThreadPoolExecutor

    from phloem.runtime.errors import InvalidRequest
    from phloem.runtime.executor.weight_group import join_group

    from .conftest import free_port

    original = engine_greedy(engine)
    name = "model.layers.0.mlp.gate_proj.weight"  # a part of the fused gate/up projection
    old = torch.tensor(engine.get_weights_by_name(name, truncate_size=10**6))
    new = ckpt.subset[name]
    assert old.shape == new.shape and not torch.equal(old, new)
    assert torch.equal(torch.tensor(engine.get_weights_by_name(name, 2)), old[:2])
    with pytest.raises(InvalidRequest) as e:
        engine.get_weights_by_name("model.layers.0.mlp.nope.weight")
    assert e.value.field == "name"

    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(engine.init_weights_update_group, "127.0.0.1", port, 1, 2, "engine_group", "gloo")
        trainer = join_group("127.0.0.1", port, 0, 2, "engine_group", "gloo")
        assert joined.result(timeout=300)[0]
        try:
            for values in (new, old):
                pending = pool.submit(
                    engine.update_weights_from_distributed, [name], ["float32"], [list(values.shape)], "engine_group"
                )
                trainer.send([values])
                ok, message = pending.result(timeout=300)
                assert ok, message
                assert torch.equal(torch.tensor(engine.get_weights_by_name(name, 3)), values[:3])
                if values is new:
                    assert engine_greedy(engine) != original
            ok, message = engine.update_weights_from_distributed([name], ["float32"], [[1, 1]], "engine_group")
            assert not ok and message.startswith("shapes:")
        finally:
            ok, message = engine.destroy_weights_update_group("engine_group")
            trainer.close()
    assert ok, message
    assert engine_greedy(engine) == original
