"""Tokenizer built from the default GGUF vs transformers' tokenizer of the same file.

transformers has no entry for the GGUF pre-tokenizer name ``smollm`` and falls back to the plain
GPT-2 split, which differs from the model's own rule (digits split one by one *before* the GPT-2
split; SmolLM2's tokenizer.json and llama.cpp do this) only where a run of two or more whitespace
characters comes right before a digit. The reference below is transformers' tokenizer
with the model's pre-tokenizer put back; the unpatched one must agree everywhere else.
"""

from __future__ import annotations

import os
import re

import pytest
from phloem.runtime.model_files import resolve_model
from phloem.runtime.tokenizer.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "Hello world 12345",
    "a   123  4",
    "x  2024年 and   7 days",
    "tab\t\t9 and newline\n\n42",
    "  leading spaces and trailing   ",
    "price: $1,234.56 (approx.)\n",
    "naïve café, 東京タワー, Привет мир, emoji 🙂🚀, math ∑∫√",
    "def f(x):\n    return x**2  # 10\n\n\nclass A:\n\tpass\n",
    'json: {"a": [1, 2,  3], "b": null}',
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say it's 5'11\" isn't it?",
    "ｆｕｌｌｗｉｄｔｈ ＡＢＣ　１２３",
    "",
    " ",
    "1",
    "   1",
]

DIVERGES = re.compile(r"\s\s\d")  # where the plain GPT-2 split and the model's rule can differ


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_gguf(resolve_model(None).path)


@pytest.fixture(scope="module")
def hf_plain():
    from transformers import AutoTokenizer

    path = resolve_model(None).path
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def hf_reference(hf_plain):
    import copy

    from tokenizers import pre_tokenizers

    ref = copy.deepcopy(hf_plain)
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return ref


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, hf_reference, hf_plain, text: str) -> None:
    ids = ours.encode(text)
    assert ids == hf_reference.encode(text, add_special_tokens=False)
    if not DIVERGES.search(text):
        assert ids == hf_plain.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.hf.encode(text, add_special_tokens=False) == ids


def test_digit_rule(ours: Tokenizer) -> None:
    assert ours.convert_ids_to_tokens(ours.encode("a   123")) == ["a", "ĠĠĠ", "1", "2", "3"]
    assert ours.convert_ids_to_tokens(ours.encode("12345")) == list("12345")


def test_special_tokens(ours: Tokenizer, hf_plain) -> None:
    assert ours.bos_token_id == 1 and ours.eos_token_id == 2
    assert {0, 2} <= ours.eos_token_ids  # <|endoftext|>, <|im_end|>
    assert ours.pad_token_id == 2 and ours.vocab_size == 49152
    assert set(ours.all_special_ids) == set(hf_plain.all_special_ids) | set(ours.all_special_ids)
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids) == "user\nhi"
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi")  # GGUF says add_bos_token=False


def test_chat_template_matches_transformers(ours: Tokenizer, hf_plain) -> None:
    for messages in (
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    ):  # fmt: skip
        for gen in (True, False):
            expect = hf_plain.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expect
    assert "You are a helpful AI assistant named SmolLM" in ours.apply_chat_template(
        [{"role": "user", "content": "x"}]
    )


def test_chat_template_helpers() -> None:
    from phloem.runtime.tokenizer.tokenizer import render_chat_template

    out = render_chat_template(
        "{{ x | tojson }}{% if y %}{{ raise_exception('bad') }}{% endif %}", x={"k": "é"}, y=False
    )
    assert out == '{"k": "é"}'
    with pytest.raises(ValueError, match="bad"):
        render_chat_template("{{ raise_exception('bad') }}")


def test_cache_roundtrip(tmp_path, monkeypatch: pytest.MonkeyPatch, ours: Tokenizer) -> None:
    monkeypatch.setenv("PHLOEM_CACHE_DIR", str(tmp_path))
    path = resolve_model(None).path
    built, cached = Tokenizer.from_gguf(path), Tokenizer.from_gguf(path)
    for text in TEXTS:
        assert built.encode(text) == cached.encode(text) == ours.encode(text)
    assert cached.chat_template == ours.chat_template and cached.eos_token_ids == ours.eos_token_ids
