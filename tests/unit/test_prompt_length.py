"""How long a prompt can be, known before (the byte floor) or part-way through (a prefix's count)
encoding it."""

from __future__ import annotations

import pytest
from phloem.runtime.tokenizer.prompt_length import PromptTooLong, encode_within, prefix_cut
from phloem.runtime.tokenizer.tokenizer import Tokenizer, build_from_gguf_metadata


def small_tokenizer(*extra_control: str, add_bos: bool = False) -> Tokenizer:
    """A byte-level BPE over ``a``, ``b`` and the space (``Ġ``), the longest piece ``Ġabab``."""
    tokens = ["a", "b", "Ġ", "ab", "abab", "Ġab", "Ġabab", "<s>", *extra_control]
    types = [1] * 7 + [3] * (1 + len(extra_control))
    backend, meta = build_from_gguf_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": ["a b", "ab ab", "Ġ ab", "Ġ abab"],
            "tokenizer.ggml.bos_token_id": 7,
            "tokenizer.ggml.add_bos_token": add_bos,
        }
    )
    return Tokenizer(backend, meta)


def test_the_longest_token_is_counted_in_bytes_of_text_not_of_its_spelling():
    tok = small_tokenizer()
    assert tok.encode(" abab abab") == [6, 6]
    assert tok.max_token_bytes == 5  # "Ġabab" is " abab"; its spelling is 6 bytes of UTF-8
    assert small_tokenizer("<|endoftext|>").max_token_bytes == 13  # an added token: its literal text


def test_the_byte_floor_is_a_floor_and_counts_the_bos():
    tok = small_tokenizer()
    for text in [" abab abab", "ab", "a b a b", "abababab ab", " " * 7, "<s>ab"]:
        assert 0 < tok.token_floor(text) <= len(tok.encode(text))
    assert tok.token_floor(" abab abab") == 2  # tight here: two tokens of five bytes
    with_bos = small_tokenizer(add_bos=True)
    assert with_bos.token_floor(" abab abab", add_special_tokens=True) == 3
    assert len(with_bos.encode(" abab abab", add_special_tokens=True)) == 3


def test_a_normalizer_leaves_the_floor_unknown():
    from tokenizers import normalizers

    tok = small_tokenizer()
    tok.backend.normalizer = normalizers.NFKC()
    assert "max_token_bytes" not in vars(tok)  # not computed yet
    assert tok.max_token_bytes is None and tok.token_floor("abab" * 100) == 0


def test_the_default_models_floor_holds_on_varied_text():
    from phloem.runtime.model_files import default_model_path

    tok = Tokenizer.from_gguf(default_model_path())
    assert tok.max_token_bytes is not None and 16 < tok.max_token_bytes < 256
    texts = ["=" * 5000, "#" * 3000, " " * 4000, "\n    " * 500, "Hello world. " * 300, "漢字🙂" * 200]
    for text in texts:
        assert tok.token_floor(text, add_special_tokens=True) <= len(tok.encode(text, add_special_tokens=True))


def test_a_prefix_is_cut_before_a_space_that_follows_a_word():
    text = "one two  three"
    assert prefix_cut(text, 20) == 3 + 4  # " three" (the space right before it follows a space)
    assert prefix_cut(text, 6) == 3
    assert prefix_cut(text, 2) is None
    assert prefix_cut("x" * 100 + " y", 101, window=10) == 100
    assert prefix_cut("x" * 100 + " y", 99, window=10) is None


class WordEncoder:
    """One token per word; records every text it encodes."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, text: str) -> list[int]:
        self.calls.append(text)
        return [len(w) for w in text.split()]


def test_a_text_over_the_limit_is_refused_from_a_prefix():
    enc = WordEncoder()
    text = "word " * 10_000  # 10k tokens
    with pytest.raises(PromptTooLong) as err:
        encode_within(text, enc, 100, first_chars=64, margin=4)
    assert 100 < err.value.at_least <= 10_000
    assert all(text.startswith(c) and text[len(c)] == " " for c in enc.calls)  # prefixes, cut at a space
    assert sum(len(c) for c in enc.calls) < len(text) / 10  # most of the text never encoded
    assert [len(c) for c in enc.calls] == sorted(len(c) for c in enc.calls)  # growing


def test_a_text_within_the_limit_comes_back_as_one_encode_of_the_whole():
    enc = WordEncoder()
    text = "word " * 90
    assert encode_within(text, enc, 100, first_chars=64, margin=4) == enc(text)
    assert enc.calls[-2] == text  # the result is the whole text's encode, not pieces of it


def test_the_margin_keeps_a_prefix_near_the_limit_from_refusing():
    enc = WordEncoder()
    text = "word " * 103  # the whole text is over 100, a prefix of ~ 102 words is not by the margin
    with pytest.raises(PromptTooLong):
        encode_within(text, enc, 100, first_chars=64, margin=0)
    assert len(encode_within(text, WordEncoder(), 100, first_chars=510, margin=4)) == 103


def test_a_text_without_spaces_is_encoded_whole():
    enc = WordEncoder()
    assert encode_within("x" * 10_000, enc, 100, first_chars=64) == [10_000]
    assert enc.calls == ["x" * 10_000]


def test_the_default_models_ids_are_those_of_a_whole_encode():
    from phloem.runtime.model_files import default_model_path

    tok = Tokenizer.from_gguf(default_model_path())
    prose = " ".join(f"Sentence {i} says something about rivers, 12 bees and café." for i in range(800))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=True)

    whole = encode(prose)
    assert encode_within(prose, encode, len(whole) + 1, first_chars=1000) == whole
    with pytest.raises(PromptTooLong) as err:
        encode_within(prose, encode, 2000, first_chars=1000)
    assert 2000 < err.value.at_least <= len(whole)
