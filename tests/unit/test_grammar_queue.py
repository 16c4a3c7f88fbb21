"""The grammar queue's failure path: a grammar that does not compile finishes its request alone,
before any token, with a 400 abort naming the grammar's field."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import StopChecker
from phloem.runtime.scheduler.grammar_queue import GrammarQueue
from phloem.runtime.scheduler.req import Req


class _Manager:
    """Compiles nothing: a grammar whose text holds ``bad`` fails, the others come back as their text."""

    def submit(self, spec: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        if "bad" in spec.text:
            fut.set_exception(ValueError("does not parse"))
        else:
            fut.set_result(spec.text)
        return fut

    def new_matcher(self, compiled: Any) -> str:
        return f"matcher({compiled})"


class _Outputs:
    def __init__(self) -> None:
        self.sent: list[Req] = []

    def add(self, req: Req) -> None:
        self.sent.append(req)

    def flush(self) -> None:
        pass


class _Scheduler:
    def __init__(self) -> None:
        self.outputs = _Outputs()


def _queue() -> GrammarQueue:
    queue = GrammarQueue(
        backend_name="none", tokenizer=None, vocab_size=8, stop_token_ids=set(), compile_timeout=1.0
    )
    queue._manager = _Manager()
    return queue


def _req(rid: str, **grammar: str) -> Req:
    params = SamplingParams(max_new_tokens=4, **grammar)
    return Req(rid=rid, origin_input_ids=[1, 2], params=params, stop_checker=StopChecker(params))


@pytest.mark.parametrize("kind", ["regex", "ebnf", "json_schema", "structural_tag"])
def test_a_grammar_that_fails_aborts_its_request_alone_naming_its_field(kind):
    queue, scheduler = _queue(), _Scheduler()
    bad, good = _req("bad", **{kind: '{"bad": true}'}), _req("good", regex="[ab]+")  # JSON for every kind
    queue.add(bad)
    queue.add(good)
    ready = queue.ready(scheduler)
    assert ready == [good] and good.grammar == "matcher([ab]+)"
    assert scheduler.outputs.sent == [bad] and not bad.output_ids
    wire = bad.finished_reason.to_wire()
    assert wire == {
        "type": "abort",
        "message": "invalid grammar: does not parse",
        "status_code": 400,
        "param": f"sampling_params.{kind}",
    }
    assert queue.pending == []
