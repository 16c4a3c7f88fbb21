"""The tokenizer manager's outbox: requests queued in one turn of the event loop reach the
scheduler as the frames of one message (so a batch submitted at once is admitted together), any
other message leaves at once after them, and a failed send aborts the requests it carried."""

from __future__ import annotations

import asyncio

import pytest
import zmq
from phloem.runtime.config import EngineArgs
from phloem.runtime.ipc import IpcPaths
from phloem.runtime.messages import AbortReq, Codec, TokenizedGenerateReq, ToScheduler
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.tokenizer.manager import TokenizerManager
from phloem.runtime.tokenizer.request import GenerateRequest


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * len(text)


class _Socket:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.sent: list[list[object]] = []  # each multipart message, decoded

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        if self.fail:
            raise zmq.Again("queue full")
        codec = Codec(ToScheduler)
        self.sent.append([codec.decode(f) for f in frames])


def _manager(socket: _Socket) -> TokenizerManager:
    tm = TokenizerManager(
        EngineArgs(), tokenizer=_Tokenizer(), ipc=IpcPaths.fresh(),
        model_info={"context_length": 4096, "vocab_size": 1000},
    )  # fmt: skip
    tm._status = "serving"
    tm.codec_sched = Codec(ToScheduler)
    tm.to_sched = socket  # type: ignore[assignment]
    return tm


def _request(rid: str) -> GenerateRequest:
    return GenerateRequest(input_ids=[5, 6, 7], rid=rid, sampling_params=SamplingParams(max_new_tokens=4))


async def _first(tm: TokenizerManager, rid: str) -> dict:
    async for out in tm.generate(_request(rid)):
        return out
    raise AssertionError("no output")


def test_requests_of_one_loop_turn_leave_as_one_message_and_an_abort_follows_them() -> None:
    sock = _Socket()
    tm = _manager(sock)

    async def main() -> None:
        tasks = [asyncio.create_task(_first(tm, f"r{i}")) for i in range(5)]
        for _ in range(3):
            await asyncio.sleep(0)
        assert [[m.rid for m in msg] for msg in sock.sent] == [[f"r{i}" for i in range(5)]]
        # a request and an abort of it in the same turn: the abort goes after the request
        late = asyncio.create_task(_first(tm, "late"))
        await asyncio.sleep(0)
        tm.abort("late")
        assert [type(m) for m in sock.sent[-1]] == [TokenizedGenerateReq, AbortReq]
        assert sock.sent[-1][0].rid == "late" and sock.sent[-1][1].rid == "late"
        for t in [*tasks, late]:
            t.cancel()
        await asyncio.gather(*tasks, late, return_exceptions=True)

    asyncio.run(main())


def test_a_failed_send_aborts_the_requests_it_carried() -> None:
    sock = _Socket(fail=True)
    tm = _manager(sock)

    async def main() -> list[dict]:
        return list(await asyncio.gather(_first(tm, "a"), _first(tm, "b")))

    outs = asyncio.run(asyncio.wait_for(main(), timeout=5))
    for out in outs:
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "could not reach the scheduler" in reason["message"]
    with pytest.raises(zmq.Again):  # a control message's sender sees the error
        tm.abort("a")
