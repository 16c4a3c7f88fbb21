"""Tensor parallelism on the CPU: ``N`` spawned ranks over gloo compute what one rank computes.

Each test starts its ranks with ``torch.multiprocessing`` (spawn), every rank joins the group
(``init_tp``, file rendezvous in the test's tmp folder), builds a :class:`ModelRunner` and runs the
same :class:`DirectBatcher` calls; the results come back as files. The test process runs the same
job as a single rank and compares: greedy tokens equal, logits equal on every rank and within
``ATOL`` of one rank's (the row-parallel sums add the same products in another order). A rank that
fails or hangs fails the test: the others are killed, nothing waits past ``RANK_TIMEOUT``.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from phloem.runtime.distributed.state import destroy_tp, init_tp
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.model_files import ModelSource, resolve_model
from phloem.runtime.models.config import ModelConfig

from tests.unit.tp_checkpoints import (
    KV_REPLICATED,
    QWEN2_BIAS,
    QWEN3_QK_NORM,
    full_checkpoint,
    write_hf_folder,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

ATOL = 1e-3  # float32 logits of magnitude ~10; TP=3 on the default model differs by ~3e-5
RANK_TIMEOUT = 240.0  # seconds for all ranks of one test

# token ids (the default model's vocabulary): plain text, code-like, repeated, short
PROMPTS = [
    [1, 504, 3458, 282, 260, 1345, 30],
    [1, 23, 456, 7890, 12, 5],
    [1, 9, 9, 9, 100, 200, 300, 400],
    [1, 2000, 40000, 123],
]
SMALL_PROMPTS = [[5, 17, 42, 99, 3, 200], [7, 7, 1, 2], [150, 3, 88, 21, 64]]


def greedy_and_logits(
    source: ModelSource, prompts: list[list[int]], new_tokens: int, **kw: Any
) -> dict[str, Any]:
    """Greedy continuations of ``prompts`` (``DirectBatcher.generate_greedy``) and the logits every
    step sampled from (``[len(prompts) * new_tokens, V]``)."""
    from phloem.runtime.sampling.sampler import Sampler

    seen: list[torch.Tensor] = []
    sampler = Sampler()

    def recording(logits: torch.Tensor, info: Any) -> torch.Tensor:
        seen.append(logits.clone())
        return sampler(logits, info)

    runner = ModelRunner(source, dtype="float32", device="cpu", max_total_tokens=1024,
                         max_running_requests=4, cpu_threads=1, sampler=recording, **kw)  # fmt: skip
    batcher = DirectBatcher(runner)
    tokens = [batcher.generate_greedy(p, new_tokens) for p in prompts]
    return {"tokens": tokens, "logits": torch.cat(seen)}


def construction_error(source: ModelSource) -> str:
    try:
        ModelRunner(source, dtype="float32", device="cpu", max_total_tokens=1024, cpu_threads=1)
    except ValueError as e:
        return str(e)
    return "no error"


# ---- jobs: what every rank (and the one-rank reference) runs; module level, so spawn finds them
def default_model_job(folders: dict[str, str]) -> dict[str, Any]:
    return greedy_and_logits(resolve_model(None), PROMPTS, 16)


def small_models_job(folders: dict[str, str]) -> dict[str, Any]:
    """Dummy weights (``tiny-llama``), then each Hugging Face folder, then the Qwen2 one with int8
    layers."""
    out = {"dummy": greedy_and_logits(ModelSource("dummy", "tiny-llama"), SMALL_PROMPTS, 8)}
    for name, path in folders.items():
        out[name] = greedy_and_logits(ModelSource("safetensors", path), SMALL_PROMPTS, 8)
    out["qwen2-int8"] = greedy_and_logits(ModelSource("safetensors", folders["qwen2-bias"]), SMALL_PROMPTS, 8,
                                          quantization="int8")  # fmt: skip
    return out


def tp2_job(folders: dict[str, str]) -> dict[str, Any]:
    """:func:`small_models_job`, and the error the default model (9 heads) gives at this size."""
    return {"default_model_error": construction_error(resolve_model(None)), **small_models_job(folders)}


def kv_replicated_job(folders: dict[str, str]) -> dict[str, Any]:
    return greedy_and_logits(ModelSource("safetensors", folders["kv_replicated"]), SMALL_PROMPTS, 8)


Job = Callable[[dict[str, str]], dict[str, Any]]


def rank_main(rank: int, size: int, rendezvous: str, job: Job, folders: dict[str, str], out: str) -> None:
    """One rank: join the group, run ``job``, leave its result (or its traceback) in ``out``."""
    torch.set_num_threads(1)
    try:
        init_tp(rank=rank, size=size, init_method=rendezvous, device=torch.device("cpu"))
        torch.save(job(folders), f"{out}/{rank}.pt")
    except BaseException:
        Path(f"{out}/{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        destroy_tp()


def run_ranks(
    size: int, job: Job, tmp_path: Path, folders: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """``job``'s result on each of ``size`` ranks; fails the test if a rank fails or hangs."""
    out = tmp_path / "ranks"
    out.mkdir()
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, size, rendezvous, job, folders or {}, str(out)), daemon=True)
             for r in range(size)]  # fmt: skip
    for p in procs:
        p.start()
    deadline = time.monotonic() + RANK_TIMEOUT
    try:
        while any(p.exitcode is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:  # the others may be waiting for it in a collective: do not wait for them
                errors = [
                    (out / f"{r}.err").read_text() if (out / f"{r}.err").exists() else "" for r in failed
                ]
                pytest.fail(f"ranks {failed} failed:\n" + "\n".join(errors))
            if time.monotonic() > deadline:
                pytest.fail(
                    f"ranks {[r for r, p in enumerate(procs) if p.exitcode is None]} still running after {RANK_TIMEOUT} s"
                )
            time.sleep(0.1)
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        assert not failed, [(out / f"{r}.err").read_text() for r in failed if (out / f"{r}.err").exists()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    return [torch.load(out / f"{r}.pt") for r in range(size)]


def assert_same_as_one_rank(ranks: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    for rank, got in enumerate(ranks):
        assert got["tokens"] == reference["tokens"], rank
        assert got["logits"].dtype == torch.float32 and got["logits"].shape == reference["logits"].shape
        assert torch.equal(got["logits"], ranks[0]["logits"]), f"rank {rank} logits differ from rank 0's"
        torch.testing.assert_close(got["logits"], reference["logits"], atol=ATOL, rtol=0)


def test_default_model_at_tp3_matches_one_rank(tmp_path: Path) -> None:
    """9 query heads and 3 KV heads over 3 ranks; the GGUF cache read slice by slice."""
    ranks = run_ranks(3, default_model_job, tmp_path)
    reference = default_model_job({})
    assert [len(t) for t in reference["tokens"]] == [16] * len(PROMPTS)
    assert_same_as_one_rank(ranks, reference)


def checkpoint_folders(root: Path, configs: dict[str, ModelConfig]) -> dict[str, str]:
    """Hugging Face folders of the small test configs (seeded full checkpoints)."""
    return {
        name: write_hf_folder(str(root / name), cfg, full_checkpoint(cfg, seed=7))
        for name, cfg in configs.items()
    }


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The ranks' results of :func:`tp2_job` (one start of two ranks for several tests), and the
    folders it read."""
    root = tmp_path_factory.mktemp("tp2")
    folders = checkpoint_folders(root, {"qwen2-bias": QWEN2_BIAS, "qwen3-qk-norm": QWEN3_QK_NORM})
    return run_ranks(2, tp2_job, root, folders), folders


def test_default_model_at_tp2_names_the_heads(tp2) -> None:
    ranks, _ = tp2
    assert [r["default_model_error"] for r in ranks] == [
        "--tp-size 2 does not divide the model's 9 attention heads"
    ] * 2


def test_small_models_at_tp2_match_one_rank(tp2) -> None:
    """Dummy weights (``tiny-llama``), Qwen2 q/k/v biases, Qwen3 q/k norms, int8 layers."""
    ranks, folders = tp2
    reference = small_models_job(folders)
    assert set(reference) == {"dummy", "qwen2-bias", "qwen3-qk-norm", "qwen2-int8"}
    for name in reference:
        assert_same_as_one_rank([r[name] for r in ranks], reference[name])


def test_kv_heads_replicated_at_tp4_match_one_rank(tmp_path: Path) -> None:
    """8 query heads over 2 KV heads at 4 ranks: two ranks hold each KV head; vocabulary 250 pads to 252."""
    folders = checkpoint_folders(tmp_path, {"kv_replicated": KV_REPLICATED})
    ranks = run_ranks(4, kv_replicated_job, tmp_path, folders)
    assert_same_as_one_rank(ranks, kv_replicated_job(folders))
