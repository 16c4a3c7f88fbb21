"""Prompt tokenization off the event loop, in batches (the tokenizer manager's encoder).

The tokenizer manager serves every request from one asyncio loop. Encoding a prompt there holds
the loop: a burst of long prompts takes a noticeable fraction of a second of serial encoding,
and during it no other request streams a token and no new request reaches the scheduler. So:

    text short and nothing queued  ->  encoded inline (a thread hop would cost more)
    otherwise                      ->  queued; texts queued while the loop runs are encoded
                                        together by one ``encode_batch`` call on a worker thread

``encode_batch`` of the Rust tokenizer releases the GIL and spreads a batch over its threads, so
the loop keeps serving while a burst is encoded, on as many cores as the machine has. One batch
runs at a time, of at most ``max_batch`` texts, so the first prompts of a burst reach the
scheduler while the rest are still being encoded; texts that arrive meanwhile join the next one.
Results come back in each caller's own order, and an error in a batch reaches every caller of
that batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

__all__ = ["BatchEncoder", "INLINE_CHARS", "MAX_BATCH"]

INLINE_CHARS = 2048  # ~500 tokens: short enough to encode inline when nothing else waits
MAX_BATCH = 16  # texts per batch: the first of a burst reach the scheduler early (GPU starts sooner)


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
    """

    def __init__(
        self,
        encode_one: Callable[[str], list[int]],
        encode_batch: Callable[[Sequence[str]], list[list[int]]],
        *,
        inline_chars: int = INLINE_CHARS,
        max_batch: int = MAX_BATCH,
    ) -> None:
        self.encode_one = encode_one
        self.encode_batch = encode_batch
        self.inline_chars = inline_chars
        self.max_batch = max_batch
        self._queued: list[tuple[str, asyncio.Future[list[int]]]] = []
        self._running = False
        self._executor: ThreadPoolExecutor | None = None
        self.batches = 0  # batch calls made (tests, metrics)

    async def encode(self, text: str) -> list[int]:
        if len(text) <= self.inline_chars and not self._queued and not self._running:
            return self.encode_one(text)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[int]] = loop.create_future()
        self._queued.append((text, fut))
        if len(self._queued) == 1 and not self._running:
            loop.call_soon(self._start_batch)  # after every caller of this loop pass has queued
        return await fut

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

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
