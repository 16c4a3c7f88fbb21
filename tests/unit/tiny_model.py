"""A tiny random Llama on the CPU for tests of the speculative and scheduling code."""

from __future__ import annotations

from phloem.runtime.executor.dummy import init_dummy_weights
from phloem.runtime.executor.model_runner import ModelRunner
from phloem.runtime.model_files import ModelSource


def tiny_runner(seed: int = 1, *, max_running_requests: int = 8) -> ModelRunner:
    """``tiny-llama`` with float32 weights drawn at std 0.2 (peaked logits: no argmax near-ties)."""
    r = ModelRunner(ModelSource("dummy", "tiny-llama"), dtype="float32", device="cpu",
                    max_total_tokens=4096, max_running_requests=max_running_requests)  # fmt: skip
    init_dummy_weights(r.model, seed=seed, std=0.2)
    return r
