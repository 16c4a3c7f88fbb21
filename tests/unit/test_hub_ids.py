"""Hugging Face model ids resolve from the local cache only: a cached id gives its snapshot folder
(through ``HF_HUB_CACHE`` as huggingface_hub reads it), an id that is not cached is one line saying
so and what to pass instead, and paths are never taken for ids."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from phloem.runtime.model_files import (
    cached_hub_snapshot,
    default_model_path,
    looks_like_hub_id,
    resolve_model,
)


def fake_cache(root, model_id: str = "org/tiny", revision: str = "0123abcd") -> str:
    """A hub cache holding ``model_id`` at ``revision``: the default GGUF, linked, as its only file."""
    folder = root / ("models--" + model_id.replace("/", "--"))
    snap = folder / "snapshots" / revision
    snap.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(revision)
    os.symlink(default_model_path(), snap / "model.gguf")
    return str(snap)


@pytest.mark.parametrize(
    ("name", "is_id"),
    [("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("/models/x", False), ("a/b/c", False),
     ("./x/y", False), ("~/x", False), ("model.gguf", False), ("org/", False)],
)  # fmt: skip
def test_what_looks_like_an_id(name, is_id):
    assert looks_like_hub_id(name) is is_id


def test_a_cached_id_is_its_snapshot(tmp_path):
    snap = fake_cache(tmp_path)
    assert cached_hub_snapshot("org/tiny", cache_dir=str(tmp_path)) == snap


def test_an_id_not_cached_is_one_line(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        cached_hub_snapshot("org/absent", cache_dir=str(tmp_path))
    message = str(err.value)
    assert "\n" not in message and "org/absent" in message and str(tmp_path) in message
    assert "does not download" in message and "--model-path" in message


def test_resolve_model_reads_the_cache_named_by_the_environment(tmp_path):
    snap = fake_cache(tmp_path)
    code = "from phloem.runtime.model_files import resolve_model; s = resolve_model('org/tiny'); print(s.kind, s.path)"
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["gguf", os.path.join(snap, "model.gguf")]


def test_a_missing_relative_path_is_still_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        resolve_model("models/absent")
