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


def test_a_missing_runtime_dependency_names_the_extra():
    """``phloem serve`` where the runtime's dependencies are not installed (uvicorn hidden here)."""
    import subprocess
    import sys

    code = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'uvicorn':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from phloem.cli import main\n"
        "sys.exit(main(['serve', '--port', '0']))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        "phloem serve: error: the module 'uvicorn' is missing; the runtime needs its extra: "
        "pip install 'phloem[runtime]'"
    ]


def test_plot_without_matplotlib_fails_before_the_run(monkeypatch, capsys):
    import argparse
    import importlib.util

    from phloem.bench import serving

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))

    async def never(*_: object) -> None:
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(serving, "serve_bench", never)
    assert serving.main(argparse.Namespace(plot="plots")) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
