"""The default engine on the CPU computes on the default GGUF's own blocks (``--quantization auto``
resolves to ``gguf``) with the fastest integer-dot kernel this CPU runs, says so in
``get_server_info``, and answers sensibly; ``--quantization none`` keeps exact float32."""

from __future__ import annotations

import pytest
import requests
from phloem.runtime.layers import qdot

GREEDY = {"temperature": 0, "max_new_tokens": 12}


def _expected_kernel() -> str:
    isas = qdot.supported_isas()
    if not isas:
        pytest.skip("no AVX2: auto keeps float32 here")
    return isas[0]


def test_default_engine_uses_the_integer_dot_kernel(engine) -> None:
    kernel = _expected_kernel()
    info = engine.get_server_info()
    assert info["device"] == "cpu"
    assert info["quantization"] == "gguf" and info["quant_kernel"] == kernel
    out = engine.generate("The capital of France is", sampling_params=GREEDY)
    assert "Paris" in out["text"]
    outs = engine.generate(["1, 2, 3, 4,", "The capital of France is"], sampling_params=GREEDY)
    assert "5" in outs[0]["text"] and "Paris" in outs[1]["text"]  # the same answers in a batch


def test_default_server_reports_the_path(server) -> None:
    kernel = _expected_kernel()
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    assert info["quantization"] == "gguf" and info["quant_kernel"] == kernel
    r = requests.post(server.url + "/generate", json={"text": "The capital of France is", "sampling_params": GREEDY},
                      timeout=120)  # fmt: skip
    assert r.status_code == 200 and "Paris" in r.json()["text"]


def test_quantization_none_keeps_float32() -> None:
    from phloem import Engine

    with Engine(quantization="none", log_level="warning") as eng:
        info = eng.get_server_info()
        assert info["quantization"] == "none" and info["quant_kernel"] is None
        assert "Paris" in eng.generate("The capital of France is", sampling_params=GREEDY)["text"]


def test_unknown_quantization_is_refused() -> None:
    from phloem import Engine

    with pytest.raises(ValueError, match="quantization"):
        Engine(quantization="int3", log_level="warning")
