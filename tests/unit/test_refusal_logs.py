"""Every refused request leaves one log line an operator can see: HTTP refusals (a bad field, an
unknown route) name the method, path, status and message; requests the engine ends with an abort
name their rid, status and message."""

from __future__ import annotations

import logging

from phloem.runtime.tokenizer.manager import _log_abort

from tests.unit.test_server_fake_tm import make_client


def test_a_bad_field_is_logged_with_its_message(caplog):
    client, _ = make_client()
    with caplog.at_level(logging.WARNING, logger="phloem.runtime.server.http_errors"):
        r = client.post("/generate", json={"text": "hi", "sampling_params": {"temperature": -1}})
    assert r.status_code == 400
    (line,) = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("refused")]
    assert line.startswith("refused POST /generate: 400 ") and "temperature" in line


def test_an_unknown_route_is_logged(caplog):
    client, _ = make_client()
    with caplog.at_level(logging.WARNING, logger="phloem.runtime.server.http_errors"):
        assert client.get("/no_such_route").status_code == 404
    assert any(rec.getMessage().startswith("refused GET /no_such_route: 404") for rec in caplog.records)


def test_an_engine_abort_is_logged_with_its_rid(caplog):
    with caplog.at_level(logging.WARNING, logger="phloem.tokenizer_manager"):
        _log_abort("r-7", {"type": "abort", "message": "invalid grammar: x", "status_code": 400})
    assert caplog.records[-1].getMessage() == "request r-7 ended with status 400: invalid grammar: x"
