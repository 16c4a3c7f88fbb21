"""Prompt tokenization off the event loop, in batches (the tokenizer manager's encoder).

The tokenizer manager serves every request from one asyncio loop. Encoding a prompt there holds
the loop: a burst of long prompts takes a noticeable fraction of a second of serial encoding,
and during it no other request streams a token and no new request reaches the scheduler. So:

    text short and nothing queued  ->  encoded inline (a thread hop would cost more)
    text past ``long_chars``       ->  encoded alone by ``encode_long`` on a pool of its own
    otherwise                      ->  queued; texts queued while the loop runs are encoded
                                        together by one ``encode_batch`` call on a worker thread

``encode_batch`` of the Rust tokenizer releases the GIL and spreads a batch over its threads, so
the loop keeps serving while a burst is encoded, on as many cores as the machine has. One batch
runs at a time, of at most ``max_batch`` texts, so the first prompts of a burst reach the
scheduler while the rest are still being encoded; texts that arrive meanwhile join the next one.
A very long text would hold its whole batch, and every batch queued behind it, for as long as
it takes to encode (seconds for megabytes); so such texts never enter a batch: each is encoded
on a separate pool of ``long_workers`` threads while the batches go on.
Results come back in each caller's own order, and an error in a batch reaches every caller of
that batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

__all__ = ["BatchEncoder", "INLINE_CHARS", "LONG_CHARS", "LONG_WORKERS", "MAX_BATCH"]

INLINE_CHARS = 2048  # ~500 tokens: short enough to encode inline when nothing else waits
MAX_BATCH = 16  # texts per batch: the first of a burst reach the scheduler early (GPU starts sooner)
LONG_CHARS = 32768  # ~8k tokens: longer texts are encoded apart from the batches of short ones
LONG_WORKERS = 2  # threads for long texts: one long text does not wait for another to finish


class BatchEncoder:
    """``await encode(text)``: token ids of ``text`` as ``encode_one`` gives them.

    Parameters
    ----------
    encode_one, encode_batch:
        The tokenizer's single and batched encoders (same ids for the same text).
    inline_chars:
        Longest text encoded on the loop itself when no batch is queued or running.
    max_batch:
        Most texts per batch; the rest of a burst waits for the next one.
    encode_long:
        Encoder of one text longer than ``long_chars`` (it may refuse the text by raising);
        by default ``encode_batch`` of that text alone, which releases the GIL.
    long_chars, long_workers:
        Texts longer than ``long_chars`` go to ``encode_long`` on a pool of ``long_workers``
        threads, never into a batch.
    """

    def __init__(
        self,
        encode_one: Callable[[str], list[int]],
        encode_batch: Callable[[Sequence[str]], list[list[int]]],
        *,
        inline_chars: int = INLINE_CHARS,
        max_batch: int = MAX_BATCH,
        encode_long: Callable[[str], list[int]] | None = None,
        long_chars: int = LONG_CHARS,
        long_workers: int = LONG_WORKERS,
    ) -> None:
        self.encode_one = encode_one
        self.encode_batch = encode_batch
        self.encode_long = encode_long or (lambda text: encode_batch([text])[0])
        self.inline_chars = inline_chars
        self.max_batch = max_batch
        self.long_chars = long_chars
        self.long_workers = long_workers
        self._queued: list[tuple[str, asyncio.Future[list[int]]]] = []
        self._running = False
        self._executor: ThreadPoolExecutor | None = None
        self._long_executor: ThreadPoolExecutor | None = None
        self.batches = 0  # batch calls made (tests, metrics)
        self.long_texts = 0  # texts sent to the long-text pool (tests, metrics)

    async def encode(self, text: str) -> list[int]:
        if len(text) > self.long_chars:
            return await self._encode_long(text)
        if len(text) <= self.inline_chars and not self._queued and not self._running:
            return self.encode_one(text)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[int]] = loop.create_future()
        self._queued.append((text, fut))
        if len(self._queued) == 1 and not self._running:
            loop.call_soon(self._start_batch)  # after every caller of this loop pass has queued
        return await fut

    def close(self) -> None:
        for pool in (self._executor, self._long_executor):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._executor = self._long_executor = None

    async def _encode_long(self, text: str) -> list[int]:
        if self._long_executor is None:
            self._long_executor = ThreadPoolExecutor(
                max_workers=self.long_workers, thread_name_prefix="phloem-tokenize-long"
            )
        self.long_texts += 1
        return await asyncio.get_running_loop().run_in_executor(self._long_executor, self.encode_long, text)

    def _start_batch(self) -> None:
        self._queued = [(t, f) for t, f in self._queued if not f.cancelled()]  # callers that left
        batch, self._queued = self._queued[: self.max_batch], self._queued[self.max_batch :]
        if not batch:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="phloem-tokenize")
        self._running = True
        self.batches += 1
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._executor, self.encode_batch, [t for t, _ in batch])
        work.add_done_callback(lambda done: self._finish(batch, done))

    def _finish(self, batch: list[tuple[str, asyncio.Future[list[int]]]], done: asyncio.Future) -> None:
        self._running = False
        error = None if done.cancelled() else done.exception()
        for i, (_, fut) in enumerate(batch):
            if fut.done():  # cancelled by its caller
                continue
            if done.cancelled():  # the executor was shut down under it
                fut.cancel()
            elif error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(done.result()[i])
        if self._queued:
            self._start_batch()
