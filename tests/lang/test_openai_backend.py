"""OpenAIBackend against a tiny local OpenAI-compatible fake."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from phloem.lang import BackendCapabilityError, OpenAIBackend

import phloem as ph


class _OpenAIFake(BaseHTTPRequestHandler):
    bodies: list = []
    echo_logprobs = True

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append((self.path, body))
        if body.get("stream"):
            return self._stream()
        if self.path == "/v1/chat/completions":
            out = {
                "id": "c1",
                "choices": [{"index": 0, "message": {"content": "hello"}, "finish_reason": "stop"}],
            }
        elif body.get("echo"):
            out = {"choices": [self._echo(p, i) for i, p in enumerate(body["prompt"])]}
        else:
            out = {
                "choices": [{"index": 0, "text": " done", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 3},
            }
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _echo(self, prompt, index):
        words = prompt.split(" ")
        tokens = [words[0]] + [" " + w for w in words[1:]]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        lps = [None] + [-1.0 if t.strip() == "blue" else -2.0 for t in tokens[1:]]
        logprobs = (
            {"tokens": tokens, "text_offset": offsets, "token_logprobs": lps} if self.echo_logprobs else None
        )
        return {"index": index, "text": prompt, "logprobs": logprobs}

    def _stream(self):
        self.send_response(200)
        self.end_headers()
        for piece in ("he", "llo"):
            chunk = {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        self.wfile.write(f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def openai_backend():
    _OpenAIFake.bodies = []
    _OpenAIFake.echo_logprobs = True
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _OpenAIFake)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield OpenAIBackend(f"http://127.0.0.1:{httpd.server_address[1]}/v1", "m", api_key="k")
    httpd.shutdown()
    httpd.server_close()


def test_assistant_gen_is_a_chat_completion(openai_backend):
    @ph.function
    def chat(s):
        s += ph.system("S") + ph.user("U")
        s += ph.assistant(ph.gen("a", max_tokens=5, json_schema={"type": "object"}))

    state = chat.run(backend=openai_backend)
    assert state["a"] == "hello"
    path, body = _OpenAIFake.bodies[0]
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert body["max_tokens"] == 5 and body["model"] == "m"
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}


def test_plain_gen_is_a_text_completion(openai_backend):
    @ph.function
    def prog(s):
        s += "Once" + ph.gen("a", stop="\n")

    state = prog.run(backend=openai_backend)
    assert state.text() == "Once done"
    path, body = _OpenAIFake.bodies[0]
    assert path == "/v1/completions" and body["prompt"] == "Once" and body["stop"] == ["\n"]


def test_stream_chat(openai_backend):
    @ph.function
    def chat(s):
        s += ph.user("U") + ph.assistant(ph.gen("a"))

    state = chat.run(backend=openai_backend, stream=True)
    assert "".join(state.text_iter("a")) == "hello" == state["a"]
    assert _OpenAIFake.bodies[0][1]["stream"] is True


def test_select_with_echo_logprobs(openai_backend):
    @ph.function
    def prog(s):
        s += "Sky is " + ph.select("c", choices=["red", "blue"])

    state = prog.run(backend=openai_backend)
    assert state.error() is None and state["c"] == "blue"
    path, body = _OpenAIFake.bodies[0]
    assert path == "/v1/completions" and body["echo"] is True and body["max_tokens"] == 0


def test_select_without_logprobs_is_a_clear_error(openai_backend):
    _OpenAIFake.echo_logprobs = False

    @ph.function
    def prog(s):
        s += "Sky is " + ph.select("c", choices=["red", "blue"])

    err = prog.run(backend=openai_backend).error()
    assert isinstance(err, BackendCapabilityError) and "prompt log probabilities" in str(err)


def test_continuing_an_assistant_turn_is_a_clear_error(openai_backend):
    @ph.function
    def chat(s):
        s += ph.user("U") + ph.assistant("Sure, " + ph.gen("a"))

    assert isinstance(chat.run(backend=openai_backend).error(), BackendCapabilityError)
