"""The built wheel holds every subpackage under the ``phloem`` namespace and imports from a fresh
virtual environment (dependencies borrowed from the test environment, never the source tree)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = [
    "phloem",
    "phloem.lang",
    "phloem.lang.backends",
    "phloem.runtime",
    "phloem.runtime.scheduler",
    "phloem.runtime.cache",
    "phloem.runtime.executor",
    "phloem.runtime.attention",
    "phloem.runtime.models",
    "phloem.runtime.layers",
    "phloem.runtime.sampling",
    "phloem.runtime.server",
    "phloem.runtime.tokenizer",
    "phloem.runtime.engine",
    "phloem.grammars",
    "phloem.grammars.tools",
    "phloem.bench",
    "phloem.training",
]


BUILD_LOG: list[str] = []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True,
        timeout=300,
        capture_output=True,
        text=True,
    )
    BUILD_LOG.append(res.stdout + res.stderr)
    (whl,) = out.glob("phloem-*.whl")
    return whl


def test_the_build_warns_of_nothing(wheel):
    """No deprecated metadata, and every shipped data file belongs to a package."""
    log = BUILD_LOG[0]
    assert "deprecated" not in log and "is absent from the `packages` configuration" not in log, log[-2000:]


def test_wheel_maps_folders_into_the_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in SUBPACKAGES:
        path = pkg.replace(".", "/")
        assert f"{path}/__init__.py" in names or f"{path}.py" in names, pkg
    assert not any(n.startswith(("lang/", "runtime/", "grammars/", "training/", "tests/")) for n in names)
    assert "phloem/training/assets/train_prompts.txt" in names
    assert "phloem/grammars/assets/json_object.ebnf" in names
    assert "phloem/runtime/speculative/assets/smollm2_135m_eagle.safetensors" in names
    assert not any("/results/" in n or "/peers/" in n for n in names)


def test_wheel_imports_every_subpackage_in_a_fresh_venv(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    # dependencies (torch, zmq, ...) come from the test environment as a plain path entry, so its
    # editable-install hooks (which point at the source tree) are not loaded
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import importlib, phloem\n"
        f"mods = {SUBPACKAGES!r}\n"
        "for m in mods: importlib.import_module(m)\n"
        "print(phloem.__file__)\n"
    )
    res = subprocess.run([py, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().startswith(site), res.stdout
