"""Run a kernel-check module under Triton's CPU interpreter, in a child process: the switch must
be set before Triton is imported, and the parent has imported it already."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


_ENV = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}


def run_interpreted(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m module *args`` with ``TRITON_INTERPRET=1`` and no visible GPU, from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env={**os.environ, **_ENV},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_interpreted_cases_pass(module: str, expected: int, *args: str, shards: int = 1) -> None:
    """Run a case module under the interpreter (as :func:`run_interpreted` does): it must exit 0 and print
    exactly ``expected`` ``ok`` lines (so a case that silently stopped running fails too).

    ``shards`` > 1 runs that many children at once, each with ``--shard K/N`` (the module keeps
    every N-th case, :func:`shard_of`) and one thread: the interpreter is single-threaded Python,
    so the cases of a long module finish in about 1/N of the time on N cores."""
    env = {**os.environ, **_ENV, **({"OMP_NUM_THREADS": "1"} if shards > 1 else {})}
    shard_args = [[]] if shards == 1 else [["--shard", f"{k}/{shards}"] for k in range(shards)]
    children = [
        subprocess.Popen([sys.executable, "-m", module, *args, *extra], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        for extra in shard_args
    ]
    procs = []
    try:
        for child in children:
            out, err = child.communicate(timeout=300)
            procs.append(subprocess.CompletedProcess(child.args, child.returncode, out, err))
    finally:
        for child in children:
            child.kill()  # a no-op for those that exited; a timed-out shard must not outlive the test
    for proc in procs:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    passed = sum(line.startswith("ok") for proc in procs for line in proc.stdout.splitlines())
    assert passed == expected, "".join(proc.stdout for proc in procs)


def shard_of(argv: list[str]) -> Callable[[], bool]:
    """From ``--shard K/N`` in ``argv``: a function called once per case, in the same order in
    every shard, that says whether this shard runs it (cases K, K + N, ...). Without the
    option every case runs."""
    if "--shard" not in argv:
        return lambda: True
    k, n = map(int, argv[argv.index("--shard") + 1].split("/"))
    seen = iter(range(1 << 30))
    return lambda: next(seen) % n == k


def run_checks(checks: Iterable[tuple[str, Callable[[], object]]]) -> int:
    """Run each ``(name, check)`` of this shard (every one without ``--shard``); print ``ok   name
    [result]`` or ``FAIL name: error`` per check (the interpreter tests count the ``ok`` lines)
    and return the number of failures. A float result is printed as the check's relative error."""
    failures = 0
    mine = shard_of(sys.argv[1:])
    for name, check in checks:
        if not mine():
            continue
        try:
            result = check()
        except AssertionError as exc:
            failures += 1
            print(f"FAIL {name}: {exc}")
            continue
        print(f"ok   {name} rel_err={result:.2e}" if isinstance(result, float) else f"ok   {name}")
    return failures


def interpreted_main(run_small: Callable[[str], int]) -> int:
    """A case module's script entry: the interpreter switch first (before the kernels' modules
    import Triton), then every small case on the CPU; exit status 1 on any failure."""
    os.environ["TRITON_INTERPRET"] = "1"
    return 1 if run_small("cpu") else 0
