"""``phloem doctor`` on a server it starts with a deliberately bad setting (one running request on a
shared-prefix workload): it names ``--max-running-requests`` and ``--schedule-policy lpm``, and
``--apply`` runs the workload again with them and shows both runs. Timing is never asserted: the
machine may be busy."""

from __future__ import annotations

import json

import pytest


def test_doctor_names_the_bad_setting_and_applies_the_fix(tmp_path, capsys):
    pytest.importorskip("aiohttp")
    from phloem.cli import main

    out_json = tmp_path / "doctor.json"
    argv = [
        "doctor", "--dataset", "shared-prefix", "--num-groups", "2",
        "--prompts-per-group", "2", "--prefix-len", "32", "--question-len", "8", "--output-len", "2",
        "--max-concurrency", "4", "--apply", "--json", str(out_json),
    ]  # fmt: skip
    if _has_matplotlib():
        argv += ["--plot", str(tmp_path / "plots")]
    argv += ["--", "--max-running-requests", "1"]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "token usage and queue: CHANGE" in out and "max_running_requests 1;" in out
    assert "change:   --max-running-requests" in out
    assert "--schedule-policy lpm" in out
    assert "== before and after" in out
    record = json.loads(out_json.read_text())
    assert record["before"]["flags"] == ["--max-running-requests", "1"]
    assert (
        "--max-running-requests" in record["suggested"] and record["suggested"]["--schedule-policy"] == "lpm"
    )
    after = record["after"]
    assert after["flags"][:2] == ["--max-running-requests", record["suggested"]["--max-running-requests"]]
    # both runs completed the whole workload
    assert (record["before"]["completed"], record["before"]["failed"]) == (4, 0)
    assert (after["completed"], after["failed"]) == (4, 0)
    assert record["before"]["summary"]["peak_running"] <= 1
    if _has_matplotlib():
        assert (tmp_path / "plots" / "doctor_before_after.png").stat().st_size > 0


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None
