"""A fake engine speaking the native ``/generate`` shape, and a tiny HTTP server around it.

Tokens are words with their leading space (``"Answer: yes"`` -> ``["Answer:", " yes"]``), so a choice
that starts without a space merges with a prefix ending in one: token healing is observable. Outputs
and log probabilities come from replaceable functions of the request.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

BOS_ID = 1
_TOKEN = re.compile(r"\s*\S+|\s+")


def default_respond(prompt: str, params: dict[str, Any]) -> str:
    """Canned output that depends on the request: constraints get a matching value."""
    if "json_schema" in params:
        return '{"name": "Ada", "age": 36}'
    regex = params.get("regex", "")
    if regex.startswith("-?(0|[1-9]"):
        return "42" if "e" not in regex else "2.5"
    if regex == "(True|False)":
        return "True"
    if regex.startswith('"'):
        return '"hi there"'
    return f"out{len(prompt)}"


def default_logprob(context: list[str], token: str) -> float:
    """Log probability of ``token`` after ``context``: shorter tokens are likelier."""
    return -0.1 * len(token.strip())


class FakeEngine:
    """Records every call; thread-safe. ``delay`` makes each generation take that long."""

    def __init__(self, *, chat_template: str | None = None, delay: float = 0.0):
        self.calls: list[dict[str, Any]] = []
        self.respond: Callable[[str, dict[str, Any]], str] = default_respond
        self.logprob: Callable[[list[str], str], float] = default_logprob
        self.chat_template = chat_template
        self.delay = delay
        self.chunk_delay = 0.0
        self.fail_with: str | None = None
        self._vocab: dict[str, int] = {}
        self._lock = threading.Lock()

    # -- tokenizer -------------------------------------------------------------------------------

    def tokens(self, text: str) -> list[str]:
        return _TOKEN.findall(text)

    def ids(self, text: str) -> list[int]:
        with self._lock:
            return [BOS_ID] + [self._vocab.setdefault(t, len(self._vocab) + 2) for t in self.tokens(text)]

    def tokenize(self, text: str) -> list[int]:
        return self.ids(text)

    # -- engine interface ------------------------------------------------------------------------

    def get_model_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"model_path": "fake/model"}
        if self.chat_template is not None:
            info["chat_template"] = self.chat_template
        return info

    def generate(
        self,
        prompt: str | list[str] | None = None,
        *,
        input_ids: list[int] | None = None,
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | None = None,
        rid: str | None = None,
        stream: bool = False,
    ) -> Any:
        call = {
            "prompt": prompt,
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
            "logprob_start_len": logprob_start_len,
            "top_logprobs_num": top_logprobs_num,
            "stream": stream,
            "start": time.monotonic(),
        }
        with self._lock:
            self.calls.append(call)
        if self.delay:
            time.sleep(self.delay)
        call["end"] = time.monotonic()
        if isinstance(prompt, list):
            return [self._one(p, call) for p in prompt]
        result = self._one(prompt or "", call)
        if stream:
            return self._chunks(result)
        n = call["sampling_params"].get("n", 1)
        return result if n == 1 else [self._one(prompt or "", call, sample=i) for i in range(n)]

    def _one(self, prompt: str, call: dict[str, Any], sample: int = 0) -> dict[str, Any]:
        if self.fail_with is not None:
            return {"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": self.fail_with}}}
        params = call["sampling_params"]
        text = "" if params.get("max_new_tokens") == 0 else self.respond(prompt, params)
        if sample:
            text += f"#{sample}"
        meta: dict[str, Any] = {
            "id": f"req{len(self.calls)}",
            "finish_reason": {"type": "length", "length": 0}
            if not text
            else {"type": "stop", "matched": None},
            "prompt_tokens": len(self.ids(prompt)),
            "completion_tokens": len(self.tokens(text)),
            "cached_tokens": 0,
        }
        if call["return_logprob"]:
            meta["input_token_logprobs"] = self._input_logprobs(prompt, max(call["logprob_start_len"], 0))
            meta["output_token_logprobs"] = [[-0.5, 0, t] for t in self.tokens(text)]
        return {"text": text, "output_ids": list(range(len(self.tokens(text)))), "meta_info": meta}

    def _input_logprobs(self, prompt: str, start: int) -> list[list[Any]]:
        toks = ["<s>", *self.tokens(prompt)]
        ids = self.ids(prompt)
        out = []
        for pos in range(start, len(toks)):
            lp = None if pos == 0 else self.logprob(toks[1:pos], toks[pos])
            out.append([lp, ids[pos], toks[pos]])
        return out

    def _chunks(self, result: dict[str, Any]):
        text = result["text"]
        for i in range(1, len(text) + 1):
            time.sleep(self.chunk_delay)
            yield {"text": text[:i], "meta_info": {"id": "s"}}
        yield result


class FakeHTTPServer:
    """Serves a :class:`FakeEngine` with SGLang's native routes on 127.0.0.1 (random port)."""

    def __init__(self, engine: FakeEngine):
        self.engine = engine
        self.requests: list[tuple[str, str, Any, dict[str, str]]] = []
        handler = _make_handler(self)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> FakeHTTPServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _make_handler(server: FakeHTTPServer) -> type[BaseHTTPRequestHandler]:
    engine = server.engine

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _record(self, body: Any) -> None:
            server.requests.append((self.command, self.path, body, dict(self.headers)))

        def do_GET(self) -> None:
            self._record(None)
            if self.path == "/get_model_info":
                return self._reply(200, engine.get_model_info())
            if self.path == "/get_server_info":
                return self._reply(200, {"version": "fake"})
            self._reply(404, {"error": "not found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length) or b"null")
            self._record(body)
            if self.path == "/flush_cache":
                return self._reply(200, {})
            if self.path == "/v1/tokenize":
                return self._reply(200, {"tokens": engine.ids(body["prompt"])})
            if self.path != "/generate":
                return self._reply(404, {"error": "not found"})
            if body["sampling_params"].get("temperature", 0) > 2:
                return self._reply(400, {"error": "temperature too high"})
            out = engine.generate(
                body.get("text"),
                sampling_params=body["sampling_params"],
                return_logprob=body.get("return_logprob", False),
                logprob_start_len=body.get("logprob_start_len", -1),
                stream=body.get("stream", False),
            )
            if body.get("stream"):
                return self._stream(out)
            self._reply(200, out)

        def _stream(self, chunks: Any) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for chunk in chunks:
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler
