"""RuntimeEndpoint's wire mapping against a local HTTP fake of the native API."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from phloem.lang import BackendError, RuntimeEndpoint
from phloem.lang.backends.runtime_http import parse_sse

import phloem as ph
from tests.lang.lang_fakes import FakeEngine, FakeHTTPServer


@pytest.fixture
def server():
    with FakeHTTPServer(FakeEngine(chat_template=None)) as srv:
        yield srv


def _posts(server, path):
    return [body for method, p, body, _ in server.requests if method == "POST" and p == path]


def test_generate_payload_and_response(server):
    backend = RuntimeEndpoint(server.url, api_key="sekret")

    @ph.function
    def prog(s):
        s += "Q:" + ph.gen(
            "a",
            max_tokens=16,
            min_tokens=2,
            stop=["\n"],
            stop_token_ids=[7],
            stop_regex=r"\d\d",
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            min_p=0.05,
            frequency_penalty=0.1,
            presence_penalty=0.2,
            ignore_eos=True,
            regex="[a-z0-9]+",
            return_logprob=True,
            top_logprobs_num=3,
        )

    state = prog.run(backend=backend)
    assert state.error() is None
    assert state["a"] == "out2"
    (body,) = _posts(server, "/generate")
    assert body == {
        "text": "Q:",
        "sampling_params": {
            "max_new_tokens": 16,
            "min_new_tokens": 2,
            "stop": ["\n"],
            "stop_token_ids": [7],
            "stop_regex": [r"\d\d"],
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": 0.05,
            "frequency_penalty": 0.1,
            "presence_penalty": 0.2,
            "ignore_eos": True,
            "regex": "[a-z0-9]+",
        },
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "top_logprobs_num": 3,
    }
    headers = server.requests[-1][3]
    assert headers["Authorization"] == "Bearer sekret"
    meta = state.get_meta_info("a")
    assert meta["finish_reason"] == {"type": "stop", "matched": None}
    assert meta["input_token_logprobs"][0][0] is None


def test_streaming_over_sse(server):
    backend = RuntimeEndpoint(server.url)

    @ph.function
    def prog(s):
        s += "abc" + ph.gen("a")

    state = prog.run(backend=backend, stream=True)
    assert "".join(state.text_iter("a")) == "out3"
    assert _posts(server, "/generate")[0]["stream"] is True
    assert state.get_meta_info("a")["prompt_tokens"] == 2


def test_select_uses_tokenize_then_one_batched_prefill(server):
    backend = RuntimeEndpoint(server.url)

    @ph.function
    def prog(s):
        s += "Pick: " + ph.select("c", choices=["red", "blue"])

    state = prog.run(backend=backend)
    assert state["c"] == "red"  # shorter token, likelier in the fake
    tokenized = [b["prompt"] for b in _posts(server, "/v1/tokenize")]
    assert tokenized == ["Pick: ", "Pick: red", "Pick: blue"]
    (scoring,) = _posts(server, "/generate")
    assert scoring["text"] == ["Pick: red", "Pick: blue"]
    assert scoring["sampling_params"] == {"max_new_tokens": 0}
    assert scoring["return_logprob"] is True and scoring["logprob_start_len"] == 0


def test_http_error_is_a_backend_error_with_the_body(server):
    backend = RuntimeEndpoint(server.url)

    @ph.function
    def prog(s):
        s += ph.gen("a", temperature=3.0)

    err = prog.run(backend=backend).error()
    assert isinstance(err, BackendError)
    assert "400" in str(err) and "temperature too high" in str(err)


def test_abort_is_never_success(server):
    server.engine.fail_with = "KV cache full"
    backend = RuntimeEndpoint(server.url)

    @ph.function
    def prog(s):
        s += ph.gen("a")

    assert "KV cache full" in str(prog.run(backend=backend).error())


def test_admin_routes_and_model_info(server):
    backend = RuntimeEndpoint(server.url + "/")
    assert backend.model_info() == {"model_path": "fake/model"}
    assert backend.server_info() == {"version": "fake"}
    backend.flush_cache()
    backend.cache_prefix("stem")
    assert _posts(server, "/flush_cache") == [None]
    assert _posts(server, "/generate") == [{"text": "stem", "sampling_params": {"max_new_tokens": 0}}]
    assert backend.chat_template().name == "chatml"


def test_model_chat_template_is_used():
    template = (
        "{% for m in messages %}[{{ m['role'] | upper }}]{{ m['content'] }}[/{{ m['role'] | upper }}]\n{% endfor %}"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
    )
    with FakeHTTPServer(FakeEngine(chat_template=template)) as srv:
        backend = RuntimeEndpoint(srv.url)

        @ph.function
        def prog(s):
            s += ph.user("hi") + ph.assistant(ph.gen("a"))

        state = prog.run(backend=backend)
    assert state.text() == f"[USER]hi[/USER]\n[ASSISTANT]{state['a']}[/ASSISTANT]\n"


def test_unreachable_server_is_a_backend_error():
    backend = RuntimeEndpoint("http://127.0.0.1:9", timeout=2)

    @ph.function
    def prog(s):
        s += ph.gen("a")

    assert isinstance(prog.run(backend=backend).error(), BackendError)


def test_tokenize_falls_back_to_prefill_when_missing():
    class NoTokenize(BaseHTTPRequestHandler):
        bodies: list = []

        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/generate":
                self.send_response(404)
                self.end_headers()
                return
            NoTokenize.bodies.append(body)
            texts = body["text"]
            out = [
                {
                    "text": "",
                    "meta_info": {"input_token_logprobs": [[None, 1, None]] + [[-1.0, ord(c), c] for c in t]},
                }
                for t in texts
            ]
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NoTokenize)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        backend = RuntimeEndpoint(f"http://127.0.0.1:{httpd.server_address[1]}")
        assert backend.tokenize(["ab", "abc"]) == [[1, 97, 98], [1, 97, 98, 99]]
        assert NoTokenize.bodies[0]["logprob_start_len"] == 0
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_parse_sse():
    lines = [b'data: {"text": "a"}', b"", b": comment", 'data: {"text": "ab"}', b"data: [DONE]", b"data: {}"]
    assert list(parse_sse(iter(lines))) == [{"text": "a"}, {"text": "ab"}]
