"""Running programs on a fake engine: text, roles, variables, scopes, typed gens, errors."""

from __future__ import annotations

import pydantic
import pytest
from phloem.lang import ProgramError
from phloem.lang.interpreter import HANDLERS
from phloem.lang.ir import (
    Gen,
    Node,
    RoleBegin,
    RoleBlock,
    RoleEnd,
    Select,
    Seq,
    Text,
    VarScopeBegin,
    VarScopeEnd,
)

import phloem as ph


def test_ir_nodes_are_frozen_and_keyword_only():
    node = ph.gen("x", max_tokens=4, stop="\n")
    assert isinstance(node, Gen)
    assert node.params.max_tokens == 4 and node.params.stop == ("\n",)
    with pytest.raises(AttributeError):
        node.name = "y"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Text("positional")  # type: ignore[misc]


def test_nodes_concatenate_with_strings():
    seq = "Q: " + ph.gen("a") + "\n"
    assert isinstance(seq, Seq)
    assert [type(i) for i in seq.items] == [Text, Gen, Text]


def test_dispatch_table_covers_every_node_type():
    concrete = {Text, Seq, Gen, Select, RoleBegin, RoleEnd, RoleBlock, VarScopeBegin, VarScopeEnd}
    assert set(HANDLERS) == concrete
    assert all(issubclass(t, Node) for t in HANDLERS)


def test_gen_mutually_exclusive_constraints():
    with pytest.raises(ValueError, match="at most one"):
        ph.gen("x", regex="a+", dtype=int)


def test_run_appends_text_and_stores_variables(backend, engine):
    @ph.function
    def qa(s, question):
        s += "Q: " + question + "\nA:"
        s += ph.gen("answer", max_tokens=8, stop=["\n"])

    state = qa.run(question="why?", backend=backend, temperature=0.3)
    assert state.error() is None
    prompt = "Q: why?\nA:"
    assert state["answer"] == f"out{len(prompt)}"
    assert state.text() == prompt + state["answer"]
    call = engine.calls[-1]
    assert call["prompt"] == prompt
    assert call["sampling_params"] == {"max_new_tokens": 8, "stop": ["\n"], "temperature": 0.3}
    assert state.get_meta_info("answer")["prompt_tokens"] == len(engine.ids(prompt))


def test_gen_params_override_program_defaults(backend, engine):
    @ph.function
    def prog(s):
        s += ph.gen("a", temperature=0.9)
        s += ph.gen("b")

    prog.run(backend=backend, temperature=0.1, max_new_tokens=5, top_p=0.5)
    first, second = (c["sampling_params"] for c in engine.calls)
    assert first == {"max_new_tokens": 5, "temperature": 0.9, "top_p": 0.5}
    assert second == {"max_new_tokens": 5, "temperature": 0.1, "top_p": 0.5}


def test_unknown_run_option_is_rejected(backend):
    @ph.function
    def prog(s):
        s += "x"

    with pytest.raises(TypeError, match="tempreature"):
        prog.run(backend=backend, tempreature=0.1)


def test_default_backend_is_used(backend):
    @ph.function
    def prog(s):
        s += ph.gen("a")

    with pytest.raises(RuntimeError, match="no backend"):
        prog.run()
    ph.set_default_backend(backend)
    assert prog.run()["a"].startswith("out")


def test_roles_value_form_markers_and_context_managers(backend):
    @ph.function
    def chat(s):
        s += ph.system("Be brief.")
        s += ph.user_begin() + "Hi" + ph.user_end()
        with s.assistant():
            s += ph.gen("reply")
        s.user("Thanks")

    state = chat.run(backend=backend)
    text = state.text()
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert text.startswith(head)
    assert text.endswith("<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n")
    assert state.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": state["reply"]},
        {"role": "user", "content": "Thanks"},
    ]


def test_nested_roles_are_an_error(backend):
    @ph.function
    def bad(s):
        s += ph.user_begin()
        s += ph.assistant("x")

    state = bad.run(backend=backend)
    assert isinstance(state.error(), ProgramError)
    assert "inside role" in str(state.error())


def test_var_scope_captures_text(backend):
    @ph.function
    def prog(s):
        s += "before "
        with s.var_scope("block"):
            s += "inside "
            s += ph.gen("g")
        s += " after"

    state = prog.run(backend=backend)
    assert state["block"] == "inside " + state["g"]
    assert state.text().endswith(" after")


def test_program_reads_its_own_variables(backend, engine):
    engine.respond = lambda prompt, params: "7" if params.get("regex") else "fine"

    @ph.function
    def prog(s):
        s += "n=" + ph.gen_int("n")
        s += " x" * s["n"]
        s += ph.gen("end")

    state = prog.run(backend=backend)
    assert state["n"] == 7
    assert engine.calls[-1]["prompt"] == "n=7" + " x" * 7


def test_typed_gens(backend):
    class Person(pydantic.BaseModel):
        name: str
        age: int

    @ph.function
    def prog(s):
        s += ph.gen_int("i") + ph.gen("f", dtype=float) + ph.gen("b", dtype=bool) + ph.gen_string("s")
        s += ph.gen_json("person", Person)
        s += ph.gen("raw", json_schema={"type": "object"})

    state = prog.run(backend=backend)
    assert state.error() is None
    assert (state["i"], state["f"], state["b"], state["s"]) == (42, 2.5, True, "hi there")
    assert state["person"] == Person(name="Ada", age=36)
    assert state["raw"] == '{"name": "Ada", "age": 36}'


def test_json_schema_goes_on_the_wire_as_a_string(backend, engine):
    @ph.function
    def prog(s):
        s += ph.gen("j", json_schema={"type": "object"}, max_tokens=9)

    prog.run(backend=backend)
    assert engine.calls[0]["sampling_params"] == {"max_new_tokens": 9, "json_schema": '{"type": "object"}'}


def test_gen_with_choices_is_a_select():
    node = ph.gen("c", choices=["a", "b"])
    assert isinstance(node, Select) and node.choices == ("a", "b")


def test_n_samples_store_a_list(backend):
    @ph.function
    def prog(s):
        s += ph.gen("many", n=3)

    state = prog.run(backend=backend)
    assert len(state["many"]) == 3 and state["many"][1].endswith("#1")


def test_backend_error_is_recorded_and_later_nodes_skipped(backend, engine):
    engine.fail_with = "out of memory"

    @ph.function
    def prog(s):
        s += ph.gen("a")
        s += "never"

    state = prog.run(backend=backend)
    assert "out of memory" in str(state.error())
    assert "never" not in state.text()
    with pytest.raises(ProgramError, match="unavailable"):
        state["a"]
    assert state.get("a", "fallback") == "fallback"


def test_error_in_program_body_is_recorded(backend):
    @ph.function
    def prog(s):
        s += "x"
        raise ValueError("boom")

    state = prog.run(backend=backend)
    assert isinstance(state.error(), ValueError)
    assert state.text() == "x"


def test_bad_output_conversion_is_an_error(backend, engine):
    engine.respond = lambda prompt, params: "not a number"

    @ph.function
    def prog(s):
        s += ph.gen_int("n")

    assert isinstance(prog.run(backend=backend).error(), ProgramError)


def test_missing_variable_is_a_key_error(backend):
    @ph.function
    def prog(s):
        s += "x"

    with pytest.raises(KeyError):
        prog.run(backend=backend)["nope"]


def test_finished_program_takes_no_more_nodes(backend):
    @ph.function
    def prog(s):
        s += "x"

    state = prog.run(backend=backend)
    with pytest.raises(ProgramError):
        state += "more"


def test_logprob_options_reach_the_engine(backend, engine):
    @ph.function
    def prog(s):
        s += "a b c" + ph.gen("g", return_logprob=True, logprob_start_len=1, top_logprobs_num=2)

    state = prog.run(backend=backend)
    call = engine.calls[0]
    assert (call["return_logprob"], call["logprob_start_len"], call["top_logprobs_num"]) == (True, 1, 2)
    assert "input_token_logprobs" in state.get_meta_info("g")
