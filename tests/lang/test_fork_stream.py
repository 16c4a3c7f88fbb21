"""Fork/join, streaming, async, tracing and run_batch's shared stem."""

from __future__ import annotations

import asyncio

import pytest
from phloem.lang import EngineBackend

import phloem as ph
from tests.lang.lang_fakes import FakeEngine


def _prefill_calls(engine):
    return [
        c for c in engine.calls if c["sampling_params"] == {"max_new_tokens": 0} and not c["return_logprob"]
    ]


@ph.function
def plan(s, goal):
    s += ph.system("You plan.")
    s += ph.user(f"Goal: {goal}.")
    branches = s.fork(3)
    for b in branches:
        b += ph.assistant(ph.gen("step", max_tokens=8))
    branches.join()
    s += ph.user("Pick one.")
    s += ph.assistant(ph.select("best", choices=["1", "2", "3"]))


def test_fork_sends_parent_prefix_once_then_children_together():
    engine = FakeEngine(delay=0.2)
    state = plan.run(goal="tea", backend=EngineBackend(engine))
    assert state.error() is None
    parent_text = "<|im_start|>system\nYou plan.<|im_end|>\n<|im_start|>user\nGoal: tea.<|im_end|>\n"
    prefills = _prefill_calls(engine)
    assert [c["prompt"] for c in prefills] == [parent_text]
    gens = [c for c in engine.calls if c["sampling_params"].get("max_new_tokens") == 8]
    assert len(gens) == 3
    assert all(c["prompt"] == parent_text + "<|im_start|>assistant\n" for c in gens)
    assert prefills[0]["end"] <= min(c["start"] for c in gens)
    # siblings overlap in time: all started before any finished
    assert max(c["start"] for c in gens) < min(c["end"] for c in gens)


def test_join_gathers_variables_and_keeps_parent_text(backend):
    state = plan.run(goal="tea", backend=backend)
    assert len(state["step"]) == 3 and all(x.startswith("out") for x in state["step"])
    assert "Pick one." in state.text()
    assert state.text().count("<|im_start|>assistant\n") == 1  # branch text is not appended
    assert state["best"] in ("1", "2", "3")
    assert len(state.get_meta_info("step")) == 3


def test_join_concate_and_append(backend):
    @ph.function
    def prog(s):
        s += "Root."
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" b{i}"
        forks.join(mode="concate_and_append")
        s += " end"

    state = prog.run(backend=backend)
    assert state.text() == "Root. b0 b1 end"


def test_fork_branch_values_and_errors_reach_parent(backend, engine):
    @ph.function
    def prog(s):
        s += "x"
        forks = s.fork(2, cache_prefix=False)
        forks[0] += ph.gen("v", max_tokens=3)
        forks[1] += ph.gen("v", temperature=5.0)
        forks[1] += ph.gen("never")
        forks.join()

    original = engine.generate

    def failing(*args, **kwargs):
        if (kwargs.get("sampling_params") or {}).get("temperature") == 5.0:
            raise RuntimeError("bad temperature")
        return original(*args, **kwargs)

    engine.generate = failing
    state = prog.run(backend=EngineBackend(engine))
    assert "bad temperature" in str(state.error())
    assert state["v"][0].startswith("out") and state["v"][1] is None
    assert _prefill_calls(engine) == []


def test_join_mode_is_checked(backend):
    @ph.function
    def prog(s):
        s.fork(2).join(mode="zip")

    assert isinstance(prog.run(backend=backend).error(), ValueError)


# -- streaming ------------------------------------------------------------------------------------------


def test_stream_text_iter_whole_and_per_variable(backend, engine):
    @ph.function
    def prog(s):
        s += "Say:"
        s += ph.gen("a")
        s += " then"
        s += ph.gen("b")

    engine.chunk_delay = 0.02
    state = prog.run(backend=backend, stream=True)
    chunks = list(state.text_iter(var="a"))
    assert len(chunks) > 1
    assert "".join(chunks) == state["a"] == "out4"
    whole = list(prog.run(backend=backend, stream=True).text_iter())
    assert "".join(whole) == state.text()
    assert all(c["stream"] for c in engine.calls)


def test_stream_text_async_iter(backend):
    @ph.function
    def prog(s, topic):
        s += f"About {topic}:" + ph.gen("a")

    async def main():
        state = await prog.arun(topic="x", backend=backend, stream=True)
        return [c async for c in state.text_async_iter()], state

    chunks, state = asyncio.run(main())
    assert "".join(chunks) == state.text() == "About x:" + state["a"]


def test_arun_without_stream(backend):
    @ph.function
    def prog(s):
        s += ph.gen("a")

    state = asyncio.run(prog.arun(backend=backend))
    assert state["a"] == "out0"


def test_stream_error_ends_iteration(backend, engine):
    engine.fail_with = "nope"

    @ph.function
    def prog(s):
        s += "x" + ph.gen("a")

    state = prog.run(backend=backend, stream=True)
    assert "".join(state.text_iter()) == "x"
    assert "nope" in str(state.error())


# -- tracing and run_batch ------------------------------------------------------------------------------


def test_trace_request_tree():
    tree = plan.trace()
    assert tree.stem == "<|im_start|>system\nYou plan.<|im_end|>\n<|im_start|>user\nGoal: "
    assert len(tree.fork_points) == 1 and len(tree.fork_points[0].branches) == 3
    kinds = [s.kind for s in tree.generations]
    assert kinds == ["gen", "gen", "gen", "select"]
    printed = str(tree)
    assert "fork x3" in printed and "gen 'step' max_tokens=8" in printed
    assert "{goal}" in printed and "branch 2" in printed
    concrete = plan.trace(goal="tea")
    assert concrete.stem.endswith("Goal: tea.<|im_end|>\n")


def test_trace_sends_nothing(backend, engine):
    plan.trace(goal="x", backend=backend)
    assert engine.calls == []


def test_trace_stops_at_values_it_cannot_know():
    @ph.function
    def prog(s):
        s += "n=" + ph.gen_int("n")
        s += "x" * int(s["n"])

    tree = prog.trace()
    assert tree.stem == "n="
    assert tree.root.steps[-1].kind == "stop"


def test_run_batch_sends_shared_stem_first(backend, engine):
    @ph.function
    def prog(s, q):
        s += ph.system("Shared instructions.")
        s += ph.user(q)
        s += ph.assistant(ph.gen("a"))

    ph.set_default_backend(backend)
    states = prog.run_batch([{"q": "one"}, {"q": "two"}, {"q": "three"}], num_threads=2, temperature=0.5)
    stem = "<|im_start|>system\nShared instructions.<|im_end|>\n<|im_start|>user\n"
    assert engine.calls[0]["prompt"] == stem
    assert engine.calls[0]["sampling_params"] == {"max_new_tokens": 0}
    assert all(c["prompt"].startswith(stem) for c in engine.calls[1:])
    assert all(c["sampling_params"] == {"temperature": 0.5} for c in engine.calls[1:])
    assert [s.messages()[1]["content"] for s in states] == ["one", "two", "three"]
    assert all(s.error() is None for s in states)


def test_run_batch_errors_stay_per_program(backend, engine):
    @ph.function
    def prog(s, n):
        s += f"n={n}"
        if n == 1:
            raise ValueError("odd")
        s += ph.gen("a")

    states = prog.run_batch([{"n": 0}, {"n": 1}, {"n": 2}], backend=backend, progress_bar=True)
    assert [type(s.error()) for s in states] == [type(None), ValueError, type(None)]
    assert _prefill_calls(engine) == [engine.calls[0]] and engine.calls[0]["prompt"] == "n="


def test_run_batch_num_threads_validation(backend):
    @ph.function
    def prog(s):
        s += "x"

    with pytest.raises(ValueError):
        prog.run_batch([{}], num_threads=0, backend=backend)
