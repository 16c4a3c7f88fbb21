"""Weight updates on CUDA through the Engine: CUDA tensors shared by IPC handle, and a trainer
broadcasting over NCCL (its own GPU: NCCL refuses two ranks on one device)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT = "The three primary colors are"
NAME = "model.layers.0.mlp.up_proj.weight"  # a part of the fused gate/up projection


@pytest.fixture(scope="module")
def cuda_engine():
    import os

    from phloem import Engine

    # the default model when it is installed; with PHLOEM_TEST_TOKENIZER (a tokenizer folder, on
    # a machine without the model) dummy weights of its shape
    tok = os.environ.get("PHLOEM_TEST_TOKENIZER")
    model = {"load_format": "dummy", "tokenizer_path": tok} if tok else {}
    eng = Engine(device="cuda", dtype="float32", log_level="warning", **model)
    yield eng
    eng.shutdown()


def greedy(engine) -> list[int]:
    engine.flush_cache()
    return engine.generate(PROMPT, sampling_params={"max_new_tokens": 16, "temperature": 0})["output_ids"]


def test_cuda_tensors_update_through_ipc_handles(cuda_engine):
    original = greedy(cuda_engine)
    old = torch.tensor(cuda_engine.get_weights_by_name(NAME, truncate_size=10**6))
    new = (old + old.std() * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))).cuda()
    ok, message = cuda_engine.update_weights_from_tensor({NAME: new})
    assert ok, message
    assert torch.equal(torch.tensor(cuda_engine.get_weights_by_name(NAME, 4)), new[:4].cpu())
    assert greedy(cuda_engine) != original
    ok, message = cuda_engine.update_weights_from_tensor([(NAME, old.cuda())])
    assert ok, message
    assert greedy(cuda_engine) == original


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the trainer on a second GPU")
def test_nccl_broadcast_from_a_trainer_gpu(cuda_engine):
    from phloem.runtime.executor.weight_group import join_group

    from .conftest import free_port

    original = greedy(cuda_engine)
    old = torch.tensor(cuda_engine.get_weights_by_name(NAME, truncate_size=10**6))
    new = old + old.std() * torch.randn(old.shape, generator=torch.Generator().manual_seed(4))
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(cuda_engine.init_weights_update_group, "127.0.0.1", port, 1, 2, "nccl_group", "nccl")
        torch.cuda.set_device(1)
        trainer = join_group("127.0.0.1", port, 0, 2, "nccl_group", "nccl", device="cuda:1")
        assert joined.result(timeout=300)[0]
        try:
            for values in (new, old):
                pending = pool.submit(
                    cuda_engine.update_weights_from_distributed, [NAME], ["float32"], [list(values.shape)], "nccl_group"
                )
                trainer.send([values])
                ok, message = pending.result(timeout=300)
                assert ok, message
                assert torch.equal(torch.tensor(cuda_engine.get_weights_by_name(NAME, 4)), values[:4])
        finally:
            cuda_engine.destroy_weights_update_group("nccl_group")
            trainer.close()
    assert greedy(cuda_engine) == original
