"""Hostile grammars through real HTTP: each is refused with a 4xx (or a clean abort carrying a
message), and the server still generates right after (``/health_generate`` answers 200)."""

from __future__ import annotations

import json
import time

import pytest
import requests

from .conftest import pool_is_idle

TIMEOUT = 120


def _deep_schema(depth: int) -> str:
    # Built as text: json.dumps of a 1,000-deep dict would itself recurse too deep.
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + "}}" * depth


RECURSIVE_REF = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}

# name -> sampling_params grammar keys
HOSTILE: dict[str, dict[str, str]] = {
    "nul_in_regex": {"regex": "ab\x00c"},
    "schema_1000_deep": {"json_schema": _deep_schema(1000)},
    "recursive_ref": {"json_schema": json.dumps(RECURSIVE_REF)},
    "regex_10000_alternatives": {"regex": "|".join(f"w{i}" for i in range(10_000))},
    "ebnf_left_recursion": {"ebnf": 'root ::= root "a" | "b"'},
    "schema_not_json": {"json_schema": '{"type": "object", "properties": '},
    "json_schema_and_regex": {"json_schema": json.dumps({"type": "integer"}), "regex": "[0-9]+"},
}


def _post_generate(url: str, grammar: dict[str, str]) -> requests.Response:
    params = {"max_new_tokens": 8, "temperature": 0, **grammar}
    return requests.post(
        url + "/generate", json={"text": "Answer:", "sampling_params": params}, timeout=TIMEOUT
    )


def _assert_refused_or_clean_abort(resp: requests.Response) -> None:
    """A 4xx with an error message, or (for a grammar a backend accepts) a 200 whose output ended
    by the grammar; never a 5xx, a hang or an empty success."""
    if 400 <= resp.status_code < 500:
        error = resp.json()["error"]
        assert error["message"] and error["code"] == resp.status_code, error
        return
    assert resp.status_code == 200, (resp.status_code, resp.text[:500])
    reason = resp.json()["meta_info"]["finish_reason"]
    assert reason["type"] in ("stop", "length"), reason


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_grammar_is_refused_and_server_stays_healthy(server, name):
    start = time.perf_counter()
    resp = _post_generate(server.url, HOSTILE[name])
    _assert_refused_or_clean_abort(resp)
    assert time.perf_counter() - start < 60
    health = requests.get(server.url + "/health_generate", timeout=TIMEOUT)
    assert health.status_code == 200, health.text


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("nul_in_regex", "regex"),
        ("schema_1000_deep", "json_schema"),
        ("regex_10000_alternatives", "regex"),
        ("schema_not_json", "json_schema"),
        ("json_schema_and_regex", "regex"),
    ],
)
def test_malformed_grammar_is_a_400_naming_the_problem(server, name, field):
    resp = _post_generate(server.url, HOSTILE[name])
    assert resp.status_code == 400, resp.text[:500]
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == f"sampling_params.{field}" and error["message"].startswith(
        f"sampling_params.{field}: "
    )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("field", "text"), [("regex", "(ab"), ("ebnf", "root ::= ("), ("json_schema", '{"type": "wat"}')]
)
def test_grammar_the_backend_rejects_is_a_400_naming_its_field(server, field, text, stream):
    """Passes the server's checks, fails in the grammar backend's compiler (in the scheduler's
    grammar queue, before the first token): a 400 naming the field, for a stream too."""
    body = {"text": "Answer:", "stream": stream, "sampling_params": {"max_new_tokens": 8, field: text}}
    resp = requests.post(server.url + "/generate", json=body, timeout=TIMEOUT)
    assert resp.status_code == 400, resp.text[:500]
    error = resp.json()["error"]
    assert error["param"] == f"sampling_params.{field}", error
    assert error["message"].startswith(f"sampling_params.{field}: invalid grammar: "), error


def test_ebnf_left_recursion_aborts_cleanly_or_parses(server):
    """A left-recursive rule either fails compilation (400) or, with an Earley backend, generates
    text in the language ``b a*``."""
    resp = _post_generate(server.url, HOSTILE["ebnf_left_recursion"])
    if resp.status_code == 200:
        out = resp.json()
        assert out["text"].startswith("b") and set(out["text"][1:]) <= {"a"}, out["text"]
    else:
        assert resp.status_code == 400 and resp.json()["error"]["message"]


def test_batch_with_one_hostile_grammar_fails_alone(server):
    """A hostile grammar in a batch fails the request; a following good request still works."""
    body = {
        "text": ["Answer:", "Answer:"],
        "sampling_params": [
            {"max_new_tokens": 4, "temperature": 0, "regex": "(yes|no)"},
            {"max_new_tokens": 4, "temperature": 0, "regex": "ab\x00c"},
        ],
    }
    resp = requests.post(server.url + "/generate", json=body, timeout=TIMEOUT)
    assert 400 <= resp.status_code < 500, resp.text[:500]
    ok = _post_generate(server.url, {"regex": "(yes|no)"})
    assert ok.status_code == 200 and ok.json()["text"] in ("yes", "no"), ok.text[:500]


def test_response_format_with_invalid_schema_is_openai_400(server):
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "bad", "schema": {"type": "object", "properties": {"a": {"type": 12}}}},
        },
    }
    resp = requests.post(server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert resp.status_code == 400, resp.text[:500]
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "code", "param"}
    assert error["message"] and error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["param"] == "response_format" and error["message"].startswith("response_format: ")


def test_pool_is_idle_after_hostile_requests(server):
    deadline = time.time() + 30
    while time.time() < deadline:
        info = requests.get(server.url + "/server_info", timeout=TIMEOUT).json()
        if pool_is_idle(info):
            return
        time.sleep(0.5)
    raise AssertionError(f"KV pool not idle: {info['live']}")
