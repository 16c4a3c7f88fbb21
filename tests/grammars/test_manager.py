"""GrammarManager: cache hits, cached failures, timeouts and stats, with a fake backend."""

from __future__ import annotations

import threading
import time

import pytest
from phloem.grammars import GrammarError, GrammarKind, GrammarSpec
from phloem.grammars.base import GrammarBackend
from phloem.grammars.manager import GrammarManager, poll, validate_spec


class FakeBackend(GrammarBackend):
    """Compiles instantly, fails on regex "bad", and waits on an event for regex "slow"."""

    name = "fake"

    def __init__(self) -> None:
        super().__init__(None, vocab_size=64, stop_token_ids=[0])
        self.compiles = 0
        self.release = threading.Event()

    def _compile(self, spec):
        self.compiles += 1
        if spec.text == "bad":
            raise RuntimeError("no good")
        if spec.text == "slow":
            self.release.wait(10)
        return spec.text

    def _new_matcher(self, handle):
        return handle


@pytest.fixture
def fake():
    backend = FakeBackend()
    yield backend
    backend.release.set()


def test_cache_hits_return_the_same_future(fake):
    manager = GrammarManager(fake)
    spec = GrammarSpec("regex", "a+")
    first = manager.submit(spec)
    assert first.result(timeout=5).spec == spec
    assert manager.submit(GrammarSpec(GrammarKind.REGEX, "a+")) is first
    stats = manager.stats()
    assert (stats.hits, stats.misses, stats.failures, fake.compiles) == (1, 1, 0, 1)
    assert stats.compile_seconds >= 0
    assert manager.new_matcher(first.result()) == "a+"


def test_failed_compile_is_cached(fake):
    manager = GrammarManager(fake)
    spec = GrammarSpec("regex", "bad")
    with pytest.raises(GrammarError, match="no good"):
        manager.compile(spec)
    with pytest.raises(GrammarError):
        manager.compile(spec)
    assert fake.compiles == 1
    assert manager.stats().failures == 1 and manager.stats().hits == 1


def test_invalid_spec_never_reaches_the_backend(fake):
    manager = GrammarManager(fake)
    future = manager.submit(GrammarSpec("json_schema", "{nope"))
    with pytest.raises(GrammarError, match="not valid JSON"):
        poll(future)
    assert fake.compiles == 0


def test_timeout_is_reported_while_the_thread_runs_on(fake):
    seen: list[float] = []
    manager = GrammarManager(fake, compile_timeout=0.2, on_compiled=seen.append)
    future = manager.submit(GrammarSpec("regex", "slow"))
    assert poll(future) is None
    with pytest.raises(GrammarError, match="did not compile within 0.2 s"):
        future.result(timeout=5)
    assert manager.stats().timeouts == 1
    fake.release.set()
    time.sleep(0.2)
    with pytest.raises(GrammarError):  # the late result does not overwrite the failure
        future.result()
    assert len(seen) == 1


def test_other_requests_compile_while_one_is_stuck(fake):
    manager = GrammarManager(fake, max_workers=2, compile_timeout=5.0)
    manager.submit(GrammarSpec("regex", "slow"))
    assert manager.compile(GrammarSpec("regex", "quick")).spec.text == "quick"


def test_lru_eviction(fake):
    manager = GrammarManager(fake, max_entries=2)
    for text in ("a", "b", "c"):
        manager.compile(GrammarSpec("regex", text))
    manager.compile(GrammarSpec("regex", "a"))
    assert fake.compiles == 4


def test_spec_is_hashable_and_normalized():
    assert GrammarSpec("json_object", "ignored") == GrammarSpec.json_object()
    assert len({GrammarSpec("regex", "a"), GrammarSpec(GrammarKind.REGEX, "a")}) == 1
    with pytest.raises(ValueError):
        GrammarSpec("yaml", "a: 1")


def test_validate_spec_accepts_ordinary_specs():
    validate_spec(GrammarSpec("regex", r"(a|b|\||[(|])+"))
    validate_spec(GrammarSpec("json_schema", '{"type": "string", "pattern": "[{]"}'))
    validate_spec(GrammarSpec("ebnf", 'root ::= "(((" root | "x"'))
