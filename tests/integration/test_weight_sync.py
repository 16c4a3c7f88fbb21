"""Weight updates broadcast by a trainer over a gloo group, on the real default model over HTTP.

The test process plays the trainer exactly as one would: it hosts the group's store as rank 0,
calls ``/init_weights_update_group`` while joining, then calls ``/update_weights_from_distributed``
and broadcasts the tensors while that call waits. Perturbed values must be read back by
``/get_weights_by_name`` and change the greedy output; broadcasting the originals must restore the
original output exactly (float32 on the CPU). Refused bodies name the field and change nothing.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from phloem.runtime.executor.weight_group import WeightGroup, join_group

from .conftest import ServerProcess, free_port

PROMPT = "The three primary colors are"
MAX_NEW = 16
GROUP = "trainer_sync"
# a fused q/k/v part, a fused gate/up part, and a plain tensor
NAMES = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight")


@pytest.fixture(scope="module")
def server(float_server):
    """Exact float32 weights: these tests read and broadcast projection weights."""
    return float_server


def post(srv: ServerProcess, path: str, body: dict) -> requests.Response:
    return requests.post(srv.url + path, json=body, timeout=600)


def greedy(srv: ServerProcess) -> list[int]:
    requests.post(srv.url + "/flush_cache", timeout=30)
    r = post(srv, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def rows(srv: ServerProcess, name: str, n: int = 3) -> torch.Tensor:
    r = post(srv, "/get_weights_by_name", {"name": name, "truncate_size": n})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json())


def update_body(tensors: dict[str, torch.Tensor], **extra) -> dict:
    return {
        "names": list(tensors),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "group_name": GROUP,
        **extra,
    }


def assert_refused(r: requests.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["success"] is False and body["error"]["param"] == param and param in body["message"], body


@pytest.fixture(scope="module")
def originals() -> dict[str, torch.Tensor]:
    from phloem.runtime.executor.weights_gguf import load_gguf_weights
    from phloem.runtime.model_files import default_model_path

    _, weights = load_gguf_weights(default_model_path())
    return {name: weights[name].float().contiguous() for name in NAMES}


def perturbed(originals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor plus seeded noise of its spread; the MLP part travels as bfloat16 (cast on copy)."""
    gen = torch.Generator().manual_seed(99)
    out = {name: (w + w.std() * torch.randn(w.shape, generator=gen)).contiguous() for name, w in originals.items()}
    out[NAMES[1]] = out[NAMES[1]].bfloat16()
    return out


def test_trainer_broadcasts_weights_over_gloo(server: ServerProcess, originals):
    srv = server
    original_out = greedy(srv)
    for name, w in originals.items():
        assert torch.equal(rows(srv, name), w[:3]), name  # the served weights are the checkpoint's

    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": GROUP, "backend": "gloo"}  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        joined = pool.submit(post, srv, "/init_weights_update_group", init)
        trainer = join_group("127.0.0.1", port, 0, 2, GROUP, "gloo")  # waits for the server to join
        r = joined.result(timeout=300)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        try:
            _refusals_change_nothing(srv, originals, original_out, init)
            new = perturbed(originals)
            r = _broadcast(srv, pool, trainer, new, check_serving=True)
            assert r.status_code == 200 and r.json()["success"] is True, r.text
            for name, w in new.items():
                assert torch.equal(rows(srv, name), w[:3].float()), name
            assert greedy(srv) != original_out

            r = _broadcast(srv, pool, trainer, originals)
            assert r.status_code == 200, r.text
            assert greedy(srv) == original_out
            for name, w in originals.items():
                assert torch.equal(rows(srv, name), w[:3]), name
        finally:
            r = post(srv, "/destroy_weights_update_group", {"group_name": GROUP})
            trainer.close()
    assert r.status_code == 200, r.text
    assert_refused(post(srv, "/update_weights_from_distributed", update_body(originals)), "group_name")


def _broadcast(srv, pool, trainer: WeightGroup, tensors: dict[str, torch.Tensor], check_serving: bool = False):
    """What a trainer does: call the route, then broadcast while it waits; the route's answer."""
    pending = pool.submit(post, srv, "/update_weights_from_distributed", update_body(tensors))
    if check_serving:
        # while the server waits for the tensors, its event loop and scheduler keep serving
        r = post(srv, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert r.status_code == 200, r.text
        assert not pending.done()
    trainer.send(list(tensors.values()))
    return pending.result(timeout=300)


def _refusals_change_nothing(srv, originals, original_out, init) -> None:
    bad_shape = {**originals, NAMES[2]: torch.ones(7)}
    assert_refused(post(srv, "/update_weights_from_distributed", update_body(bad_shape)), "shapes")
    unknown = {**originals, "model.layers.0.self_attn.nope.weight": torch.ones(3)}
    assert_refused(post(srv, "/update_weights_from_distributed", update_body(unknown)), "names")
    other_group = update_body(originals, group_name="no_such_group")
    assert_refused(post(srv, "/update_weights_from_distributed", other_group), "group_name")
    assert_refused(post(srv, "/update_weights_from_distributed", {**update_body(originals), "dtypes": ["int8"] * 3}),
                   "dtypes")  # fmt: skip
    assert_refused(post(srv, "/update_weights_from_distributed", {**update_body(originals), "extra": 1}), "extra")
    assert_refused(post(srv, "/init_weights_update_group", init), "group_name")  # already joined
    assert_refused(post(srv, "/init_weights_update_group", {**init, "group_name": "g2", "backend": "nccl"}), "backend")
    r = post(srv, "/get_weights_by_name", {"name": "model.layers.0.self_attn.nope.weight"})
    assert_refused(r, "name")
    assert "nope" in r.json()["message"]
    assert greedy(srv) == original_out
    for name, w in originals.items():
        assert torch.equal(rows(srv, name), w[:3]), name
