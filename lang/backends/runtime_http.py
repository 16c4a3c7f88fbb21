"""``RuntimeEndpoint``: our server (or any SGLang-native server) over HTTP."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import requests
from phloem.lang.backends.base import BackendError
from phloem.lang.backends.native import NativeBackend, Payload


class RuntimeEndpoint(NativeBackend):
    """Talks to ``base_url`` with SGLang's native API: ``/generate``, ``/get_model_info``,
    ``/flush_cache``, ``/get_server_info`` and ``/v1/tokenize``.

    Parameters
    ----------
    base_url:
        Server root, for example ``http://127.0.0.1:30000``.
    api_key:
        Sent as ``Authorization: Bearer <api_key>`` when given.
    timeout:
        Seconds to wait for any one response.
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._local = threading.local()
        self._info: dict[str, Any] | None = None
        self._has_tokenize = True

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"

    # -- transport -----------------------------------------------------------------------------

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _request(self, method: str, path: str, *, body: Payload | None = None, stream: bool = False):
        url = self.base_url + path
        try:
            resp = self._session().request(
                method, url, json=body, headers=self._headers, timeout=self.timeout, stream=stream
            )
        except requests.RequestException as exc:
            raise BackendError(f"{method} {url} failed: {exc}") from exc
        if resp.status_code >= 400:
            raise BackendError(f"{method} {path} -> HTTP {resp.status_code}: {resp.text[:2000]}")
        return resp

    def _send(self, payload: Payload) -> Payload | list[Payload]:
        return self._request("POST", "/generate", body=payload).json()

    def _send_stream(self, payload: Payload) -> Iterator[Payload]:
        with self._request("POST", "/generate", body=payload, stream=True) as resp:
            yield from parse_sse(resp.iter_lines(decode_unicode=True))

    # -- admin ---------------------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = self._request("GET", "/get_model_info").json()
        return self._info

    def server_info(self) -> dict[str, Any]:
        """``GET /get_server_info``."""
        return self._request("GET", "/get_server_info").json()

    def flush_cache(self) -> None:
        """``POST /flush_cache``: drop the server's cached prefixes."""
        self._request("POST", "/flush_cache")

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids via ``/v1/tokenize``; falls back to a prefill when the server lacks it."""
        if self._has_tokenize:
            try:
                return [
                    self._request("POST", "/v1/tokenize", body={"prompt": t}).json()["tokens"] for t in texts
                ]
            except (BackendError, KeyError, ValueError):
                self._has_tokenize = False
        return super().tokenize(texts)

    def close(self) -> None:
        session = getattr(self._local, "session", None)
        if session is not None:
            session.close()


def parse_sse(lines: Iterator[str | bytes]) -> Iterator[Payload]:
    """Decode ``data: {json}`` lines up to ``data: [DONE]``; other lines are ignored."""
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if not line or not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if isinstance(chunk, dict) and "error" in chunk and "text" not in chunk:
            raise BackendError(f"stream error: {chunk['error']}")
        yield chunk
