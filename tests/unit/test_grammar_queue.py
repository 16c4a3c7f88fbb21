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


class _DeviceManager(_Manager):
    """The device route's compiles: ``huge`` fails (a DFA over the limits); the others come back as
    an object whose matcher carries an automaton of ``states`` states."""

    def submit(self, spec: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        if "huge" in spec.text:
            fut.set_exception(ValueError("the grammar's automaton has 9999 states"))
        else:
            fut.set_result(spec.text)
        return fut

    def new_matcher(self, compiled: Any) -> Any:
        return _AutomatonMatcher(compiled)


class _AutomatonMatcher:
    def __init__(self, text: str) -> None:
        self.text = text
        self.automaton = _AUTOMATA.setdefault(text, _automaton())
        self.state = 0

    def automaton_state(self) -> int:
        return self.state


STATES = 5


def _automaton() -> Any:
    """A token automaton of ``STATES`` states over 8 tokens that allows nothing (shape only)."""
    import numpy as np
    from phloem.grammars.automaton import TokenAutomaton

    return TokenAutomaton(
        state_ids=np.arange(STATES, dtype=np.int64),
        masks=np.zeros((STATES, 1), dtype=np.int32),
        keys=np.zeros(0, dtype=np.int64),
        targets=np.zeros(0, dtype=np.int32),
        initial=0,
        vocab_size=8,
    )


_AUTOMATA: dict[str, Any] = {}


def _device_queue(max_states: int = 64) -> GrammarQueue:
    from phloem.grammars.automaton import AutomatonTable

    queue = _queue()
    queue.automata = AutomatonTable(vocab_size=8, num_rows=4, device="cpu", max_states=max_states)
    queue._device_manager = _DeviceManager()
    return queue


def test_a_regular_grammar_takes_the_device_route_and_others_the_host():
    queue, scheduler = _device_queue(), _Scheduler()
    regex, ebnf = _req("r", regex="[ab]+"), _req("e", ebnf='root ::= "a"')
    queue.add(regex)
    queue.add(ebnf)
    assert regex.grammar_on_device and not ebnf.grammar_on_device
    assert queue.ready(scheduler) == [regex, ebnf]
    assert isinstance(regex.grammar, _AutomatonMatcher) and regex.automaton.offset == 1
    assert ebnf.grammar == 'matcher(root ::= "a")' and ebnf.automaton is None


def test_a_grammar_the_device_cannot_take_falls_back_to_the_host_backend():
    queue, scheduler = _device_queue(), _Scheduler()
    req = _req("h", regex="huge[ab]+")
    queue.add(req)
    assert queue.ready(scheduler) == [] and queue.pending == [req]  # resubmitted to the host backend
    assert queue.ready(scheduler) == [req]
    assert req.grammar == "matcher(huge[ab]+)" and req.automaton is None and not scheduler.outputs.sent


def test_a_full_table_leaves_the_row_on_host_masks():
    queue, scheduler = _device_queue(max_states=1 + STATES), _Scheduler()
    first, second = _req("a", regex="a+"), _req("b", regex="b+")
    queue.add(first)
    queue.add(second)
    assert queue.ready(scheduler) == [first, second]
    assert first.automaton is not None and second.automaton is None  # no room while "a" runs
    assert isinstance(second.grammar, _AutomatonMatcher)  # its matcher fills host masks


def test_launch_rows_start_where_the_host_knows_the_state():
    """Known state: the matcher's, as a table state; a step in flight: -1 (continue on the device);
    unconstrained or a discarded prefill chunk: free."""
    from phloem.grammars.automaton import FREE

    queue, scheduler = _device_queue(), _Scheduler()
    reqs = [_req("known", regex="x+"), _req("flight", regex="x+"), _req("chunk", regex="x+"), _req("free")]
    for r in reqs[:3]:
        queue.add(r)
    queue.ready(scheduler)
    for row, r in enumerate(reqs):
        r.req_pool_idx = row
    reqs[0].grammar.state = 3
    reqs[1].pending_outputs = 1
    launch, rows, init = queue.automaton_rows(reqs, [False, False, True, False])
    assert rows.tolist() == [0, 1, 2, 3]
    assert init.tolist() == [reqs[0].automaton.offset + 3, -1, FREE, FREE]
    assert launch.snapshot is queue.automata.snapshot
    assert queue.automaton_rows([reqs[3]], [False]) is None  # no row on the device: no automaton work


def test_a_launch_whose_rows_all_continue_writes_no_starting_state():
    """In the overlap loop's steady state every row continues from the device: the launch reads
    ``state`` as it is, and writes nothing before sampling."""
    import torch

    queue, scheduler = _device_queue(), _Scheduler()
    reqs = [_req("a", regex="x+"), _req("b", regex="y+")]
    for r in reqs:
        queue.add(r)
    queue.ready(scheduler)
    for row, r in enumerate(reqs):
        r.req_pool_idx, r.pending_outputs = row, 1
    launch, rows, init = queue.automaton_rows(reqs, [False, False])
    assert init.tolist() == [-1, -1]
    queue.automata.state[:2] = torch.tensor([3, 4], dtype=torch.int32)
    assert launch.current(rows, init).tolist() == [3, 4]
    reqs[0].pending_outputs = 0  # one row known: its state is written first
    launch, rows, init = queue.automaton_rows(reqs, [False, False])
    assert launch.current(rows, init).tolist() == [reqs[0].automaton.offset, 4]
