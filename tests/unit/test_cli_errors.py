"""Argument errors of ``phloem``: two lines (the error, named by the subcommand, and where its
options are listed), exit status 2, never the whole usage."""

from __future__ import annotations

import pytest

from phloem.cli import main


@pytest.mark.parametrize(
    ("argv", "head"),
    [
        (["serve", "--dtype", "fp8"], "phloem serve: error: argument --dtype: invalid choice: 'fp8'"),
        (["serve", "--no-such-flag", "3"], "phloem serve: error: unrecognized arguments: --no-such-flag 3"),
        (["generate"], "phloem generate: error: the following arguments are required: --prompt"),
        (["nosuch"], "phloem: error: argument command: invalid choice: 'nosuch'"),
    ],
)
def test_argument_errors_are_two_lines(argv, head, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(head), lines
    command = head.split(":")[0]
    assert lines[1] == f"(see '{command} --help')"
