"""``PHLOEM_LOOP_TRACE``: the scheduler process's per-iteration host times (a diagnosis aid)."""

from __future__ import annotations

from phloem.runtime.scheduler.process import LoopTrace
from phloem.runtime.scheduler.scheduler import StepTimes


def test_off_without_the_variable(monkeypatch) -> None:
    monkeypatch.delenv("PHLOEM_LOOP_TRACE", raising=False)
    assert LoopTrace.from_env() is None


def test_lines_skip_idle_polls_and_count_from_the_first_busy_iteration(tmp_path, monkeypatch) -> None:
    path = tmp_path / "loop.txt"
    monkeypatch.setenv("PHLOEM_LOOP_TRACE", str(path))
    trace = LoopTrace.from_env()
    assert trace is not None
    idle = StepTimes("", 0, 0.0, 0.0, 0.0)
    trace.add(10.0, 10.2, 10.2001, 0, idle)  # a 200 ms poll that received nothing: skipped
    trace.add(11.0, 11.001, 11.0161, 3, StepTimes("EXTEND", 3, 0.002, 0.003, 0.010))
    trace.add(11.5, 11.5, 11.5101, 0, StepTimes("DECODE", 3, 0.0001, 0.0002, 0.0098))
    lines = path.read_text().splitlines()
    assert lines[0].split() == [
        "t_ms",
        "recv_ms",
        "msgs",
        "kind",
        "rows",
        "schedule_ms",
        "launch_ms",
        "process_ms",
    ]
    first, second = (line.split() for line in lines[1:])
    assert len(lines) == 3
    assert first == ["0.00", "1.00", "3", "EXTEND", "3", "2.00", "3.00", "10.00"]
    assert second[:5] == ["500.00", "0.00", "0", "DECODE", "3"]
    assert float(second[7]) == 9.8
