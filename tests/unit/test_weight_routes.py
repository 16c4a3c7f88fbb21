"""The weight-group and weight-reading routes against a fake TokenizerManager: strict bodies (a
400 naming the field, nothing sent on), the messages they send, and SGLang's answers."""

from __future__ import annotations

from typing import Any

from phloem.runtime.messages import (
    ControlReply,
    DestroyWeightsGroupReq,
    GetWeightsReq,
    InitWeightsGroupReq,
    UpdateWeightsFromDistributedReq,
)

from tests.unit.test_server_fake_tm import make_client

INIT = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
UPDATE = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[576]]}


def client_with_calls():
    client, tm = make_client()
    calls: list[tuple[type, dict[str, Any]]] = []

    async def weights_control(kind: type, **fields: Any) -> ControlReply:
        calls.append((kind, fields))
        if fields.get("name") == "model.nope.weight":
            return ControlReply(req_id=0, ok=False, message="name: no such tensor", data={"field": "name"})
        if kind is GetWeightsReq:
            return ControlReply(req_id=0, ok=True, data={"values": [[1.0, 2.0], [3.0, 4.0]]})
        return ControlReply(req_id=0, ok=True, message="done")

    tm.weights_control = weights_control
    return client, calls


def assert_400(r, param: str) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["success"] is False and body["error"]["param"] == param, body


def test_group_routes_send_the_body_fields():
    client, calls = client_with_calls()
    r = client.post("/init_weights_update_group", json=INIT)
    assert r.status_code == 200 and r.json() == {"success": True, "message": "done"}
    r = client.post("/update_weights_from_distributed", json={**UPDATE, "flush_cache": False})
    assert r.status_code == 200, r.text
    r = client.post("/destroy_weights_update_group", json={"group_name": "weight_update_group"})
    assert r.status_code == 200, r.text
    assert calls == [
        (InitWeightsGroupReq, {**INIT, "group_name": "weight_update_group"}),
        (UpdateWeightsFromDistributedReq, {**UPDATE, "group_name": "weight_update_group", "flush_cache": False,
                                           "abort_all_requests": False}),
        (DestroyWeightsGroupReq, {"group_name": "weight_update_group"}),
    ]  # fmt: skip


def test_bad_bodies_are_refused_naming_the_field():
    client, calls = client_with_calls()
    for path, body, param in (
        ("/init_weights_update_group", {**INIT, "backend": "mpi"}, "backend"),
        ("/init_weights_update_group", {**INIT, "master_port": "29500"}, "master_port"),  # strict: no coercion
        ("/init_weights_update_group", {**INIT, "rank_offset": 0}, "rank_offset"),
        ("/init_weights_update_group", {**INIT, "world_sise": 2}, "world_sise"),
        ("/update_weights_from_distributed", {**UPDATE, "names": []}, "names"),
        ("/update_weights_from_distributed", {**UPDATE, "shapes": [["576"]]}, "shapes"),
        ("/update_weights_from_distributed", {"dtypes": ["float32"], "shapes": [[576]]}, "names"),
        ("/destroy_weights_update_group", {"group": "x"}, "group"),
        ("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": -1}, "truncate_size"),
        ("/get_weights_by_name", {}, "name"),
    ):
        assert_400(client.post(path, json=body), param)
    assert calls == []


def test_get_weights_by_name_answers_the_values_as_a_list():
    client, calls = client_with_calls()
    r = client.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 2})
    assert r.status_code == 200 and r.json() == [[1.0, 2.0], [3.0, 4.0]]
    assert calls == [(GetWeightsReq, {"name": "model.norm.weight", "truncate_size": 2})]
    r = client.post("/get_weights_by_name", json={"name": "model.nope.weight"})
    assert_400(r, "name")
    assert "no such tensor" in r.json()["message"]
