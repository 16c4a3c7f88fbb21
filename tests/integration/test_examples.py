"""Every program in examples/ runs on the default model and gives a sane result."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

import phloem as ph

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def examples():
    """Import an example module by name (the examples import their sibling ``connect``)."""
    sys.path.insert(0, str(EXAMPLES))
    yield importlib.import_module
    sys.path.remove(str(EXAMPLES))


def test_every_example_is_tested():
    tested = set(re.findall(r'examples\("(\w+)"\)', Path(__file__).read_text()))
    programs = {p.stem for p in EXAMPLES.glob("*.py")} - {"connect"}
    assert programs <= tested


def test_few_shot_qa(examples, server):
    answers = examples("few_shot_qa").main(server.url)
    assert set(answers) == set(examples("few_shot_qa").QUESTIONS)
    assert "Paris" in answers["What is the capital of France?"]
    assert all(a and "\n" not in a for a in answers.values())


def test_multi_turn_chat_in_process(examples, engine):
    module = examples("multi_turn_chat")
    state = module.main(ph.EngineBackend(engine))
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * len(module.QUESTIONS)
    assert all(m["content"].strip() for m in messages)
    assert state.text() == engine.tm.tokenizer.apply_chat_template(messages, add_generation_prompt=False)


def test_tree_of_thought(examples, server):
    module = examples("tree_of_thought")
    state = module.main(server.url)
    ideas = state["idea"]
    assert isinstance(ideas, list) and len(ideas) == module.NUM_IDEAS
    assert all(isinstance(i, str) and i.strip() for i in ideas)
    assert state["best"] in {str(i + 1) for i in range(module.NUM_IDEAS)}
    scores = state.get_meta_info("best")["scores"]
    assert len(scores) == module.NUM_IDEAS and scores[int(state["best"]) - 1] == max(scores)
    for meta in state.get_meta_info("idea"):  # branches reused the prefix sent at the fork
        assert meta["cached_tokens"] >= meta["prompt_tokens"] - 8


def test_json_extraction(examples, server):
    module = examples("json_extraction")
    person = module.main(server.url)
    assert isinstance(person, module.Person)
    assert "Alice" in person.name and person.age == 34


def test_agent_tools_runs_the_tools_it_picks(examples, server):
    module = examples("agent_tools")
    state = module.main(server.url)
    assert state.error() is None
    assert state["tool0"] in [*module.TOOLS, "finish"]
    steps = module.steps_of(state)
    for step in steps:
        fn, pattern = module.TOOLS[step["tool"]]
        assert re.fullmatch(pattern, step["arg"])
        assert f"Argument: {step['arg']}\nObservation: {fn(step['arg'])}\n" in state.text()
    assert steps and steps[0]["tool"] == "calculator" and "84" in state.text()
    assert isinstance(state["answer"], str)


def test_batch_progress_64(examples, server, capsys):
    module = examples("batch_progress")
    states = module.main(server.url)
    assert len(states) == len(module.INPUTS) == 64
    assert all(st.error() is None for st in states)
    labels = [st["label"] for st in states]
    assert set(labels) <= set(module.LABELS)
    expected = ["positive" if any(w in r for w in module.GOOD) else "negative" for r in module.INPUTS]
    accuracy = sum(a == b for a, b in zip(labels, expected)) / len(labels)
    assert accuracy >= 0.75, accuracy
    assert "64/64" in capsys.readouterr().err  # the progress bar ran to the end


def test_openai_backend(examples, server):
    state = examples("openai_backend").main(server.url)
    assert state.error() is None
    assert "Paris" in state["answer"]
    assert state["is_city"] in {"yes", "no"}


def test_rl_reinforce_pushes_each_step_to_the_engine(examples, capsys):
    module = examples("rl_reinforce")
    history = module.main(["--steps", "2", "--batch", "4"])
    out = capsys.readouterr().out
    assert history["updates"] == 2 and "done: 2 weight updates pushed to the engine" in out
    assert len(history["rewards"]) == 2 and all(0.0 <= r <= 1.0 for r in history["rewards"])
    # the trainer's own forward gives the logprobs the engine reported, before and after a push
    assert all(gap < 1e-3 for gap in history["gaps"]), history["gaps"]
    assert out.count("pushed model.norm.weight") == 2
