"""Role markers derived from jinja2 chat templates."""

from __future__ import annotations

import pytest
from phloem.lang import ChatTemplate, EngineBackend
from phloem.lang.chat_template import register_chat_template, registered_chat_template

import phloem as ph
from tests.lang.lang_fakes import FakeEngine

LLAMA3_LIKE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

MERGES_SYSTEM = (  # puts the system prompt inside the first user turn (llama-2 style)
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set msgs = messages[1:] %}"
    "{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}{% if m['role'] == 'user' %}[INST] {% if loop.first and sys %}<<SYS>>{{ sys }}<</SYS>> {% endif %}"
    "{{ m['content'] }} [/INST]{% else %} {{ m['content'] }}</s>{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    ("role", "prefix", "suffix"),
    [
        ("system", "<|im_start|>system\n", "<|im_end|>\n"),
        ("user", "<|im_start|>user\n", "<|im_end|>\n"),
        ("assistant", "<|im_start|>assistant\n", "<|im_end|>\n"),
    ],
)
def test_chatml_markers(role, prefix, suffix):
    markers = ChatTemplate.registered("chatml").markers(role)
    assert (markers.prefix, markers.suffix) == (prefix, suffix)


@pytest.mark.parametrize(
    ("role", "prefix"),
    [
        ("system", "<|start_header_id|>system<|end_header_id|>\n\n"),
        ("user", "<|start_header_id|>user<|end_header_id|>\n\n"),
        ("assistant", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ],
)
def test_llama3_like_markers_leave_out_bos(role, prefix):
    template = ChatTemplate(LLAMA3_LIKE, bos_token="<|begin_of_text|>")
    markers = template.markers(role)
    assert markers.prefix == prefix and markers.suffix == "<|eot_id|>"


def test_template_that_merges_roles_falls_back_to_a_simpler_context():
    template = ChatTemplate(MERGES_SYSTEM)
    assert template.markers("user").prefix == "[INST] "
    assert template.markers("assistant").prefix == " "
    assert template.markers("assistant").suffix == "</s>"


def test_render_matches_markers_for_a_conversation():
    template = ChatTemplate(LLAMA3_LIKE)
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
    ]
    by_markers = "".join(
        template.markers(m["role"]).prefix + m["content"] + template.markers(m["role"]).suffix
        for m in messages
    )
    assert by_markers == template.render(messages)


def test_template_from_model_info_and_registry():
    assert ChatTemplate.from_model_info({"model_path": "m"}).name == "chatml"
    custom = ChatTemplate.from_model_info({"model_path": "m", "chat_template": LLAMA3_LIKE})
    assert custom.source == LLAMA3_LIKE
    register_chat_template("test-llama3", LLAMA3_LIKE)
    assert registered_chat_template("test-llama3") == LLAMA3_LIKE
    with pytest.raises(ValueError):
        register_chat_template("test-llama3", LLAMA3_LIKE)
    with pytest.raises(KeyError):
        registered_chat_template("missing")


def test_program_roles_render_with_the_engine_template():
    backend = EngineBackend(FakeEngine(chat_template=LLAMA3_LIKE))

    @ph.function
    def chat(s):
        s += ph.system("S")
        with s.user():
            s += "U"
        s += ph.assistant(ph.gen("a"))

    state = chat.run(backend=backend)
    expected = ChatTemplate(LLAMA3_LIKE).render(
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": state["a"]},
        ]
    )
    assert state.text() == expected


DEFAULT_SYSTEM = (  # adds a system prompt when the conversation does not start with one (SmolLM2 style)
    "{% for m in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nDefault.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_first_message_markers_keep_the_templates_default_system_prompt():
    template = ChatTemplate(DEFAULT_SYSTEM)
    assert (
        template.markers("user", first=True).prefix
        == "<|im_start|>system\nDefault.<|im_end|>\n<|im_start|>user\n"
    )
    assert template.markers("user").prefix == "<|im_start|>user\n"
    assert template.markers("system", first=True).prefix == "<|im_start|>system\n"


@pytest.mark.parametrize("with_system", [True, False])
def test_program_text_equals_the_template_render_with_or_without_a_system_turn(with_system):
    backend = EngineBackend(FakeEngine(chat_template=DEFAULT_SYSTEM))

    @ph.function
    def chat(s):
        if with_system:
            s += ph.system("S")
        s += ph.user("U")
        s += ph.assistant(ph.gen("a"))

    state = chat.run(backend=backend)
    assert state.text() == ChatTemplate(DEFAULT_SYSTEM).render(state.messages())
    tree = chat.trace(backend=backend)
    assert state.text().startswith(tree.stem)
