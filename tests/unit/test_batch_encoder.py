"""BatchEncoder: prompts encoded off the event loop, together when they arrive together."""

from __future__ import annotations

import asyncio
import threading

import pytest
from phloem.runtime.tokenizer.batch_encoder import BatchEncoder


class Recorder:
    """A word-splitting tokenizer that records its calls and the thread they ran on."""

    def __init__(self, fail: str | None = None) -> None:
        self.one: list[str] = []
        self.batches: list[list[str]] = []
        self.threads: set[str] = set()
        self.fail = fail

    def encode_one(self, text: str) -> list[int]:
        self.one.append(text)
        return [len(w) for w in text.split()]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        self.threads.add(threading.current_thread().name)
        self.batches.append(list(texts))
        if self.fail is not None and any(self.fail in t for t in texts):
            raise ValueError("bad text")
        return [[len(w) for w in t.split()] for t in texts]


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def test_a_short_text_alone_is_encoded_inline():
    rec = Recorder()
    enc = BatchEncoder(rec.encode_one, rec.encode_batch, inline_chars=64)
    assert run(enc.encode("ab cde")) == [2, 3]
    assert rec.one == ["ab cde"] and rec.batches == [] and enc.batches == 0


def test_texts_arriving_together_share_one_batch_off_the_loop_in_their_order():
    rec = Recorder()
    enc = BatchEncoder(rec.encode_one, rec.encode_batch, inline_chars=4)
    texts = [f"{'x' * (i + 5)} {'y' * i}" for i in range(1, 9)]

    async def main() -> list[list[int]]:
        try:
            return list(await asyncio.gather(*(enc.encode(t) for t in texts)))
        finally:
            enc.close()

    assert run(main()) == [[i + 5, i] for i in range(1, 9)]
    assert rec.batches == [texts] and enc.batches == 1 and rec.one == []
    assert all(name.startswith("phloem-tokenize") for name in rec.threads)


def test_texts_arriving_during_a_batch_form_the_next_one():
    rec = Recorder()
    gate = threading.Event()
    first_batch = rec.encode_batch

    def held(texts: list[str]) -> list[list[int]]:  # the first batch runs until the gate opens
        if not rec.batches:
            gate.wait(10)
        return first_batch(texts)

    enc = BatchEncoder(rec.encode_one, held, inline_chars=1000)

    async def main() -> tuple[list[int], list[int], list[int]]:
        first = asyncio.ensure_future(enc.encode("a " * 600))  # long: queued
        await asyncio.sleep(0.05)  # its batch of one is running
        # short, but a batch is running: queued behind it rather than overtaking it inline
        second = asyncio.ensure_future(enc.encode("bb"))
        third = asyncio.ensure_future(enc.encode("ccc dd"))
        await asyncio.sleep(0)
        gate.set()
        try:
            return await first, await second, await third
        finally:
            enc.close()

    a, b, c = run(main())
    assert a == [1] * 600 and b == [2] and c == [3, 2]
    assert [len(batch) for batch in rec.batches] == [1, 2] and rec.one == []


def test_an_error_reaches_every_caller_of_its_batch_and_not_the_next():
    rec = Recorder(fail="BAD")
    enc = BatchEncoder(rec.encode_one, rec.encode_batch, inline_chars=0)

    async def main() -> tuple[list, list[int]]:
        try:
            together = await asyncio.gather(
                enc.encode("ok one"), enc.encode("BAD two"), return_exceptions=True
            )
            later = await enc.encode("fine")
            return together, later
        finally:
            enc.close()

    together, later = run(main())
    assert all(isinstance(r, ValueError) for r in together)
    assert later == [4]


def test_a_caller_that_leaves_does_not_disturb_the_others():
    rec = Recorder()
    enc = BatchEncoder(rec.encode_one, rec.encode_batch, inline_chars=0)

    async def main() -> list[int]:
        gone = asyncio.ensure_future(enc.encode("gone away"))
        kept = asyncio.ensure_future(enc.encode("kept here ok"))
        await asyncio.sleep(0)
        gone.cancel()
        try:
            with pytest.raises(asyncio.CancelledError):
                await gone
            return await kept
        finally:
            enc.close()

    assert run(main()) == [4, 4, 2]


def test_the_tokenizer_encodes_a_batch_as_it_encodes_each_text():
    from phloem.runtime.model_files import default_model_path
    from phloem.runtime.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path())
    texts = [
        "Hello world",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "  leading spaces and ünïcödé 漢字 🙂",
        "",
        "x" * 5000,
    ]
    for special in (False, True):
        assert tok.encode_batch(texts, add_special_tokens=special) == [
            tok.encode(t, add_special_tokens=special) for t in texts
        ]


def test_short_texts_do_not_wait_behind_a_long_one():
    """A long text is encoded on its own pool: while it is still being encoded, short texts that
    came after it are batched and answered."""
    rec = Recorder()
    gate = threading.Event()
    longs: list[str] = []

    def slow_long(text: str) -> list[int]:  # holds its worker until the gate opens
        longs.append(threading.current_thread().name)
        if not gate.wait(10):
            raise TimeoutError("the gate never opened")
        return rec.encode_batch([text])[0]

    enc = BatchEncoder(rec.encode_one, rec.encode_batch, inline_chars=4, encode_long=slow_long, long_chars=100)
    done: list[str] = []

    async def main() -> list[list[int]]:
        async def encode(name: str, text: str) -> list[int]:
            ids = await enc.encode(text)
            done.append(name)
            return ids

        long = asyncio.ensure_future(encode("long", "w " * 500))
        await asyncio.sleep(0)
        shorts = [asyncio.ensure_future(encode(f"short{i}", f"s{i} text")) for i in range(3)]
        try:
            short_ids = await asyncio.wait_for(asyncio.gather(*shorts), 10)
            assert done == ["short0", "short1", "short2"] and not long.done()  # the long one is still held
            gate.set()
            return [await long, *short_ids]
        finally:
            gate.set()
            enc.close()

    ids = run(main())
    assert ids[0] == [1] * 500 and ids[1:] == [[2, 4], [2, 4], [2, 4]]
    assert done[-1] == "long" and enc.long_texts == 1
    assert rec.batches[0] == ["s0 text", "s1 text", "s2 text"]  # the shorts' batch: the long text is not in it
    assert longs and all(name.startswith("phloem-tokenize-long") for name in longs)


def test_long_texts_are_encoded_side_by_side_and_a_refusal_reaches_only_its_caller():
    rec = Recorder()
    started: list[str] = []
    both_started = threading.Barrier(2, timeout=10)  # each waits for the other: they run at once

    def long_encode(text: str) -> list[int]:
        started.append(text[:3])
        both_started.wait()
        if text.startswith("BAD"):
            raise ValueError("too long")
        return rec.encode_batch([text])[0]

    enc = BatchEncoder(rec.encode_one, rec.encode_batch, encode_long=long_encode, long_chars=10, long_workers=2)

    async def main() -> list:
        try:
            return list(
                await asyncio.gather(enc.encode("BAD " * 10), enc.encode("ok! " * 10), return_exceptions=True)
            )
        finally:
            enc.close()

    bad, ok = run(main())
    assert isinstance(bad, ValueError) and ok == [3] * 10
    assert sorted(started) == ["BAD", "ok!"] and enc.batches == 0


def test_by_default_a_long_text_is_a_batch_of_one_on_the_long_pool():
    rec = Recorder()
    enc = BatchEncoder(rec.encode_one, rec.encode_batch, long_chars=10)

    async def main() -> list[int]:
        try:
            return await enc.encode("abc " * 10)
        finally:
            enc.close()

    assert run(main()) == [3] * 10
    assert rec.batches == [["abc " * 10]] and enc.batches == 0 and enc.long_texts == 1
    assert all(name.startswith("phloem-tokenize-long") for name in rec.threads)
