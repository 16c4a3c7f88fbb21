"""Prompt order checks: a changing argument ahead of a long constant text is named in a warning,
and run_batch reports how much of its prompts the calls share."""

from __future__ import annotations

import logging

import pytest
from phloem.lang.prefix_check import (
    MIN_STEM_CHARS,
    late_stems,
    shared_prefix_ratio,
    varying_arguments,
)
from phloem.lang.tracer import TracedValue

import phloem as ph

RULES = "Follow these rules carefully. " * 12  # 360 constant characters


@ph.function
def stamped(s, now, question):
    s += f"Time: {now}\n" + RULES + "Question: " + question + "\n"
    s += ph.gen("answer", max_tokens=4)


@ph.function
def fixed(s, now, question):
    s += RULES + f"Time: {now}\nQuestion: " + question + "\n"
    s += ph.gen("answer", max_tokens=4)


def test_varying_arguments() -> None:
    calls = [{"a": 1, "b": [1, 2], "c": "x"}, {"a": 1, "b": [1, 3], "c": "x", "d": 0}]
    assert varying_arguments(calls) == ["b", "d"]
    assert varying_arguments([{"a": 1}]) == []


def test_late_stems_needs_the_minimum_of_constant_text_after_the_argument() -> None:
    ts, q = TracedValue("now"), TracedValue("question")
    text = f"Time: {ts}\n" + "x" * MIN_STEM_CHARS + f"{q}"
    [late] = late_stems(text, ["now", "question"])
    assert (late.argument, late.offset, late.stem_chars) == ("now", 6, MIN_STEM_CHARS + 1)
    short = f"Time: {ts}\n" + "x" * (MIN_STEM_CHARS - 2) + f"{q}"
    assert late_stems(short, ["now", "question"]) == []
    # an argument that does not change is never named, however long the text after it
    assert late_stems(text, ["question"]) == []
    # the last argument has no constant text after it: nothing to name
    assert late_stems(f"{'y' * 500}{ts}", ["now"]) == []


def test_shared_prefix_ratio() -> None:
    assert shared_prefix_ratio(["abcd", "abcd"]) == 0.5
    assert shared_prefix_ratio(["abXX", "abYY", "zz"]) == 2 / 10
    assert shared_prefix_ratio(["only one"]) == 0.0
    assert shared_prefix_ratio(["x", "y"]) == 0.0


def test_run_batch_warns_about_a_changing_argument_ahead_of_the_rules(backend, caplog) -> None:
    calls = [{"now": f"10:00:0{i}", "question": f"q{i}"} for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="phloem.lang"):
        bad = stamped.run_batch(calls, backend=backend)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "'now'" in warnings[0] and f"{len(chr(10) + RULES + 'Question: ')} characters" in warnings[0]
    assert "'question'" not in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="phloem.lang"):
        good = fixed.run_batch(calls, backend=backend)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert good.shared_prefix_ratio > bad.shared_prefix_ratio
    assert bad.shared_prefix_ratio == pytest.approx(
        len("Time: 10:00:0")
        * 2
        / sum(len(f"Time: 10:00:0{i}\n" + RULES + f"Question: q{i}\n") for i in range(3))
    )
    assert [s["answer"] for s in good] and all(s.error() is None for s in good)


def test_single_runs_warn_once_when_the_argument_changes(backend, caplog) -> None:
    @ph.function
    def prog(s, user):
        s += f"User: {user}\n" + RULES
        s += ph.gen("a", max_tokens=2)

    with caplog.at_level(logging.WARNING, logger="phloem.lang"):
        prog.run(user="ann", backend=backend)
        prog.run(user="ann", backend=backend)  # unchanged: nothing to say
        assert not caplog.records
        prog.run(user="bob", backend=backend)
        prog.run(user="cy", backend=backend)
    assert len(caplog.records) == 1 and "'user'" in caplog.records[0].getMessage()
