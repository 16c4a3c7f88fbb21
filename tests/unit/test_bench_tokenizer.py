"""Where ``phloem bench serving`` gets its tokenizer: ``--tokenizer`` folder/GGUF/default, and the
server's ``GET /tokenizer`` (export, rebuild, HTTP errors)."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import pytest
from phloem.bench.bench_tokenizer import (
    TokenizerSourceError,
    bench_tokenizer,
    fetch_server_tokenizer,
    load_tokenizer,
    tokenizer_from_payload,
)
from phloem.runtime.model_files import default_model_path, resolve_model
from phloem.runtime.tokenizer.tokenizer import Tokenizer
from phloem.runtime.tokenizer.tokenizer import load_tokenizer as load_for_model

from tests.unit.test_server_fake_tm import make_client

TEXT = "Read the passage: 12 apples, <|im_end|> and naïve café.\n"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def default_tok() -> Tokenizer:
    return load_for_model(resolve_model(None))


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> None:
    assert a.encode(TEXT) == b.encode(TEXT)
    assert a.encode(TEXT, add_special_tokens=True) == b.encode(TEXT, add_special_tokens=True)
    assert a.apply_chat_template(CHAT) == b.apply_chat_template(CHAT)
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (
        b.bos_token_id,
        b.eos_token_id,
        b.pad_token_id,
    )
    assert a.eos_token_ids == b.eos_token_ids and a.vocab_size == b.vocab_size


def write_folder(tok: Tokenizer, folder) -> None:
    files = tok.to_hf_files()
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(files["tokenizer_json"]))
    (folder / "tokenizer_config.json").write_text(json.dumps(files["tokenizer_config"]))
    (folder / "generation_config.json").write_text(json.dumps(files["generation_config"]))


# ---- export and rebuild ----------------------------------------------------------------------------
def test_hf_files_round_trip(default_tok):
    files = default_tok.to_hf_files()
    assert set(files) == {"tokenizer_json", "tokenizer_config", "generation_config"}
    assert (
        files["tokenizer_config"]["eos_token"]
        == default_tok.convert_ids_to_tokens([default_tok.eos_token_id])[0]
    )
    same_tokenizer(default_tok, Tokenizer.from_hf_files(**files))
    # tokenizer.json as text, as read from a file, builds the same tokenizer
    as_text = json.dumps(files["tokenizer_json"])
    same_tokenizer(
        default_tok, Tokenizer.from_hf_files(as_text, files["tokenizer_config"], files["generation_config"])
    )


def test_generation_config_adds_end_ids(default_tok):
    files = default_tok.to_hf_files()
    extra = max(default_tok.eos_token_ids) + 5
    rebuilt = Tokenizer.from_hf_files(
        files["tokenizer_json"], files["tokenizer_config"], {"eos_token_id": [extra]}
    )
    assert extra in rebuilt.eos_token_ids and default_tok.eos_token_ids <= rebuilt.eos_token_ids


# ---- --tokenizer PATH -------------------------------------------------------------------------------
def test_tokenizer_folder_gguf_and_default(default_tok, tmp_path):
    folder = tmp_path / "tok"
    write_folder(default_tok, folder)
    same_tokenizer(default_tok, load_tokenizer(str(folder)))  # a tokenizer folder (no weights)
    same_tokenizer(default_tok, load_tokenizer(default_model_path()))  # a GGUF file
    same_tokenizer(default_tok, load_tokenizer("default"))
    same_tokenizer(default_tok, load_tokenizer(None))


def test_tokenizer_path_errors_name_the_flag(tmp_path):
    with pytest.raises(TokenizerSourceError, match="--tokenizer: no such file or folder"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerSourceError, match="--tokenizer: .*tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty"))


def test_payload_without_tokenizer_is_refused():
    with pytest.raises(TokenizerSourceError, match="without tokenizer_json, tokenizer_config"):
        tokenizer_from_payload({"model_path": "x"}, "http://h/tokenizer")
    with pytest.raises(TokenizerSourceError, match="does not load"):
        tokenizer_from_payload({"tokenizer_json": {"model": 3}, "tokenizer_config": {}}, "http://h/tokenizer")


# ---- GET /tokenizer --------------------------------------------------------------------------------
def test_route_serves_the_tokenizer_once_built(default_tok):
    client, tm = make_client()
    tm.tokenizer = default_tok
    r = client.get("/tokenizer")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    same_tokenizer(default_tok, tokenizer_from_payload(r.json(), "test"))
    tm.tokenizer = None  # the body was kept: a second call does not export again
    assert client.get("/tokenizer").content == r.content


def test_route_404_when_the_tokenizer_cannot_be_exported():
    client, _ = make_client()  # the fake tokenizer has no files to export
    r = client.get("/tokenizer")
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "this server's tokenizer cannot be exported"


def test_route_needs_the_api_key():
    client, _ = make_client(api_key="secret")
    assert client.get("/tokenizer").status_code == 401


def test_fetch_from_a_closed_port_says_so():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(TokenizerSourceError, match=f"cannot fetch the tokenizer from {url}/tokenizer"):
        asyncio.run(fetch_server_tokenizer(url))
    with pytest.raises(TokenizerSourceError):  # 'server' is the same request
        asyncio.run(bench_tokenizer("server", url))


async def fetch_from_canned(status: int, body: str) -> str:
    """The error ``fetch_server_tokenizer`` raises against a server answering ``status``/``body``."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=status, text=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/tokenizer", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        with pytest.raises(TokenizerSourceError) as info:
            await fetch_server_tokenizer(str(server.make_url("/")))
    finally:
        await server.close()
    return str(info.value)


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (
            404,
            '{"detail": "Not Found"}',
            r"answered HTTP 404 .*does not export its tokenizer; pass --tokenizer",
        ),
        (401, '{"error": "key"}', r"answered HTTP 401 .*pass --api-key"),
        (503, '{"error": "starting"}', r"answered HTTP 503 .*pass --tokenizer"),
        (200, "<html>", r"not JSON"),
        (200, '{"model_path": "m"}', r"without tokenizer_json, tokenizer_config: not a tokenizer"),
    ],
)
def test_fetch_errors_say_what_to_do(status, body, expected):
    message = asyncio.run(fetch_from_canned(status, body))
    assert re.search(expected, message), message
    assert "/tokenizer" in message
