"""The DSL against the real runtime on the default model, over HTTP (``RuntimeEndpoint``) and in
process (``EngineBackend``): prefix sharing, select, chat templates, greedy parity, streaming and
pydantic outputs."""

from __future__ import annotations

import uuid

import pydantic
import pytest
import requests

import phloem as ph

# How many stem tokens a child may recompute: the runtime never matches a whole prompt (it keeps one
# token to compute), and the stem's last token may merge with the text appended after it.
SLACK = 3


@pytest.fixture(params=["http", "engine"])
def backend(request):
    if request.param == "http":
        server = request.getfixturevalue("server")
        backend = ph.RuntimeEndpoint(server.url)
        yield backend
        backend.close()
    else:
        yield ph.EngineBackend(request.getfixturevalue("engine"))


def fresh_stem(words: int = 120) -> str:
    """A stem no earlier request has cached: it starts with a random tag."""
    return (
        f"[{uuid.uuid4().hex[:12]}] " + "Facts about rivers: rivers flow to the sea. " * (words // 8) + "\n"
    )


def token_count(backend: ph.Backend, text: str) -> int:
    return len(backend.tokenize([text])[0])  # type: ignore[attr-defined]


def test_fork_children_reuse_the_stem(backend):
    stem = fresh_stem()

    @ph.function
    def branches(s):
        s += stem + "Question: name a river."
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += f" Answer {i}:" + ph.gen("river", max_tokens=2, temperature=0.7)
        forks.join()

    state = branches.run(backend=backend)
    assert state.error() is None
    stem_tokens = token_count(backend, stem + "Question: name a river.")
    metas = state.get_meta_info("river")
    assert len(metas) == len(state["river"]) == 4
    for meta in metas:
        assert meta["cached_tokens"] >= stem_tokens - SLACK, (meta, stem_tokens)


def test_run_batch_items_reuse_the_stem(backend):
    stem = fresh_stem()

    @ph.function
    def item(s, x):
        s += stem + f"Item {x}:" + ph.gen("out", max_tokens=1, temperature=0)

    states = item.run_batch([{"x": i} for i in range(6)], backend=backend)
    stem_tokens = token_count(backend, stem)
    assert item.trace(backend=backend).stem == stem + "Item "
    for st in states:
        meta = st.get_meta_info("out")
        assert st.error() is None
        assert meta["cached_tokens"] >= stem_tokens - SLACK, (meta, stem_tokens)


def test_select_picks_the_easy_answer_and_reports_scores(backend):
    @ph.function
    def capital(s):
        s += "Q: What is the capital of France?\nA: The capital of France is "
        s += ph.select("city", choices=["Tokyo", "Paris", "Lima"])

    state = capital.run(backend=backend)
    meta = state.get_meta_info("city")
    assert state["city"] == "Paris"
    assert meta["choices"] == ["Tokyo", "Paris", "Lima"] and meta["index"] == 1
    assert len(meta["scores"]) == 3 and max(meta["scores"]) == meta["scores"][1]
    assert state.text().endswith("is Paris")


@ph.function
def conversation(s, with_system, open_assistant):
    if with_system:
        s += ph.system("You are terse.")
    s += ph.user("Hi there.")
    s += ph.assistant("Hello!")
    with s.user():
        s += "What is 2 + 2?"
    if open_assistant:
        s += ph.assistant_begin()


@pytest.mark.parametrize("with_system", [True, False])
@pytest.mark.parametrize("open_assistant", [True, False])
def test_role_text_matches_the_chat_template(server, engine, with_system, open_assistant):
    tokenizer = engine.tm.tokenizer
    for backend in (ph.RuntimeEndpoint(server.url), ph.EngineBackend(engine)):
        state = conversation.run(with_system=with_system, open_assistant=open_assistant, backend=backend)
        expected = tokenizer.apply_chat_template(state.messages(), add_generation_prompt=open_assistant)
        assert state.text() == expected
        traced = conversation.trace(with_system=with_system, open_assistant=open_assistant, backend=backend)
        assert traced.stem == expected


def test_role_text_tokenizes_like_a_chat_completion(server):
    backend = ph.RuntimeEndpoint(server.url)
    state = conversation.run(with_system=False, open_assistant=True, backend=backend)
    model = requests.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": state.messages(), "max_tokens": 1, "temperature": 0}
    usage = requests.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["usage"]
    assert usage["prompt_tokens"] == token_count(backend, state.text())


def test_greedy_output_is_the_same_over_http_and_in_process(server, engine):
    @ph.function
    def story(s):
        s += ph.user("Write one sentence about the moon.")
        s += ph.assistant(ph.gen("line", max_tokens=12, temperature=0))
        s += "\nNumbers: 1, 2, 3," + ph.gen("more", max_tokens=6, temperature=0)

    over_http = story.run(backend=ph.RuntimeEndpoint(server.url))
    in_process = story.run(backend=ph.EngineBackend(engine))
    assert over_http.error() is None and in_process.error() is None
    assert over_http["line"] and over_http.text() == in_process.text()


def test_streaming_text_iter_against_the_server(server):
    @ph.function
    def count(s):
        s += "Count: 1, 2, 3," + ph.gen("rest", max_tokens=10, temperature=0, ignore_eos=True)

    state = count.run(backend=ph.RuntimeEndpoint(server.url), stream=True)
    chunks = list(state.text_iter("rest"))
    assert len(chunks) > 1 and "".join(chunks) == state["rest"]
    assert state.get_meta_info("rest")["completion_tokens"] == 10

    whole = count.run(backend=ph.RuntimeEndpoint(server.url), stream=True)
    text = "".join(whole.text_iter())
    assert text == whole.text() and text.startswith("Count: 1, 2, 3,")


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    is_capital: bool


def test_gen_json_schema_returns_a_parsed_model(backend):
    @ph.function
    def city(s):
        s += ph.user("Describe Paris as JSON.")
        s += ph.assistant(ph.gen("city", json_schema=City, max_tokens=48, temperature=0))

    state = city.run(backend=backend)
    assert state.error() is None
    assert isinstance(state["city"], City)
    assert state.get_meta_info("city")["finish_reason"]["type"] == "stop"
