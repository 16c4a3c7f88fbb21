"""The tokenizer manager refuses a prompt text that cannot fit the context before encoding it
(its byte length rules it out) or part-way through (a prefix does), and otherwise sends the ids
of a plain encode of the whole text."""

from __future__ import annotations

import asyncio

import pytest
from phloem.runtime.config import EngineArgs
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.ipc import IpcPaths
from phloem.runtime.tokenizer.manager import TokenizerManager

BOS = 1


class WordTokenizer:
    """One token per word (BOS first with special tokens), at most 8 bytes a token; records
    every text it encodes."""

    max_token_bytes = 8

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def token_floor(self, text: str, add_special_tokens: bool = False) -> int:
        return -(-len(text.encode()) // self.max_token_bytes) + int(add_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded.append(text)
        return [BOS] * add_special_tokens + [len(w) for w in text.split()]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]


def manager(tokenizer: WordTokenizer, context: int) -> TokenizerManager:
    return TokenizerManager(
        EngineArgs(), tokenizer=tokenizer, ipc=IpcPaths.fresh(),
        model_info={"context_length": context, "vocab_size": 1000},
    )  # fmt: skip


def encode(tm: TokenizerManager, text: str, add_special_tokens: bool = True) -> list[int]:
    async def main() -> list[int]:
        try:
            return await tm.encode_prompt(text, add_special_tokens=add_special_tokens)
        finally:
            tm._encoder.close()
            tm._raw_encoder.close()

    return asyncio.run(main())


def test_a_text_whose_bytes_rule_it_out_is_refused_unencoded():
    tok = WordTokenizer()
    tm = manager(tok, 1000)
    with pytest.raises(InvalidRequest) as err:
        encode(tm, "x" * 8000)  # at least 1000 tokens of 8 bytes, plus BOS
    assert err.value.field == "text"
    assert err.value.message == "the prompt has at least 1001 tokens; the model's context length is 1000"
    assert tok.encoded == []


def test_a_text_whose_prefix_rules_it_out_is_refused_unfinished():
    tok = WordTokenizer()
    tm = manager(tok, 5000)
    text = "ab " * 12_000  # 36000 bytes: the byte floor (4501) passes; 12000 words do not fit
    with pytest.raises(InvalidRequest) as err:
        encode(tm, text)
    assert err.value.field == "text" and "the prompt has at least" in err.value.message
    assert tok.encoded and all(len(t) < len(text) for t in tok.encoded)  # never the whole text
    assert tm._encoder.long_texts == 1


def test_the_context_length_is_read_when_a_text_is_encoded():
    """The server learns the context length from the scheduler after the manager is built."""
    tok = WordTokenizer()
    tm = manager(tok, 0)
    tm.context_len = 5000
    text = "abcdef " * 4700  # fits 5000
    assert len(encode(tm, text)) == 4701
    tm.context_len = 1000
    with pytest.raises(InvalidRequest, match="at least"):
        encode(tm, text)


def test_a_long_text_that_fits_gets_the_ids_of_a_whole_encode():
    tok = WordTokenizer()
    tm = manager(tok, 5000)
    text = "abcdef " * 4700  # 32900 chars: a long text; a prefix of 20000 fits, then the whole
    assert encode(tm, text) == [BOS] + [6] * 4700
    assert len(tok.encoded) == 2 and tok.encoded[-1] == text and tm._encoder.long_texts == 1


def test_without_special_tokens_no_bos_is_counted_or_added():
    tok = WordTokenizer()
    tm = manager(tok, 10)
    assert encode(tm, "one two", add_special_tokens=False) == [3, 3]
    with pytest.raises(InvalidRequest, match="at least 10 tokens"):
        encode(tm, "y" * 80, add_special_tokens=False)  # exactly the context: refused
    assert tok.encoded == ["one two"]
