"""Engine options: CLI flags and Engine keywords come from one dataclass; docs stay in sync."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from phloem.runtime.config import EngineArgs, config_markdown


def test_cli_flags_round_trip_into_engine_args():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--max-total-tokens", "1000", "--disable-radix-cache", "--schedule-policy", "lpm",
                            "--mem-fraction-static", "0.5", "--speculative-algorithm", "NGRAM"])
    args = EngineArgs.from_cli(ns)
    assert args.max_total_tokens == 1000 and args.disable_radix_cache and args.schedule_policy == "lpm"
    assert args.mem_fraction_static == 0.5 and args.speculative_algorithm == "NGRAM"
    assert args.model_path is None and args.port == 30000


def test_unknown_engine_keyword_is_a_clear_error():
    with pytest.raises(TypeError, match="max_totl_tokens"):
        EngineArgs.from_kwargs(None, max_totl_tokens=3)


def test_bad_choice_is_rejected_by_the_cli():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--schedule-policy", "random"])


def test_config_doc_is_generated_from_the_fields():
    doc = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert doc.read_text() == config_markdown(), "regenerate: python -m phloem.runtime.config > docs/config.md"


def test_overlap_loop_runs_on_cuda_by_default_and_on_the_cpu_only_when_asked():
    from phloem.runtime.scheduler.builder import use_overlap

    assert use_overlap(EngineArgs(), "cuda")
    assert not use_overlap(EngineArgs(), "cpu")
    assert use_overlap(EngineArgs(enable_cpu_overlap_schedule=True), "cpu")
    assert not use_overlap(EngineArgs(disable_overlap_schedule=True), "cuda")
    assert not use_overlap(EngineArgs(disable_overlap_schedule=True, enable_cpu_overlap_schedule=True), "cpu")
    assert not use_overlap(EngineArgs(speculative_algorithm="NGRAM"), "cuda")
    assert not use_overlap(EngineArgs(speculative_algorithm="NGRAM", enable_cpu_overlap_schedule=True), "cpu")


def test_default_prefill_chunk_follows_the_device_and_the_model_size():
    from phloem.runtime.scheduler.builder import SMALL_MODEL_BYTES, default_chunked_prefill_size

    assert default_chunked_prefill_size("cpu", 270 << 20) == 512
    assert default_chunked_prefill_size("cuda", 1_200 << 20) == 16384  # Qwen3-0.6B: launch-bound at 8k
    assert default_chunked_prefill_size("cuda", SMALL_MODEL_BYTES - 1) == 16384
    assert default_chunked_prefill_size("cuda", SMALL_MODEL_BYTES) == 8192
    assert default_chunked_prefill_size("cuda", 15 << 30) == 8192  # Llama-3-8B: GPU-bound at 8k
    assert default_chunked_prefill_size("cuda") == 8192  # size unknown


def test_build_scheduler_takes_the_default_chunk_for_its_device():
    from phloem.runtime.scheduler.builder import build_scheduler

    args = EngineArgs(load_format="dummy", device="cpu", max_total_tokens=4096, max_running_requests=4)
    scheduler, rt = build_scheduler(args, send=lambda m: None)
    assert rt.info["chunked_prefill_size"] == 512 == scheduler.cfg.chunked_prefill_size


def test_engine_keywords_outside_their_choices_fail_before_any_process_starts():
    """The command line checks choices; ``Engine(**kwargs)`` reaches ``check_supported`` unchecked."""
    from phloem.runtime.launch import check_supported

    from phloem import Engine

    check_supported(EngineArgs(warmup="on", speculative_algorithm=None, hicache_storage_backend="file"))
    for bad, flag in ((dict(warmup="sometimes"), "--warmup sometimes"), (dict(dtype="fp16"), "--dtype fp16"),
                      (dict(speculative_algorithm="eagle"), "--speculative-algorithm eagle")):  # fmt: skip
        with pytest.raises(ValueError, match=flag) as e:
            check_supported(EngineArgs(**bad))
        assert "expected one of" in str(e.value)
    with pytest.raises(ValueError, match="--schedule-policy lifo: expected one of fcfs, lpm"):
        Engine(schedule_policy="lifo")


def test_secrets_never_leave_through_public_dict_or_repr():
    import dataclasses

    from phloem.runtime.config import REDACTED

    args = EngineArgs(api_key="sk-very-secret")
    secrets = [f.name for f in dataclasses.fields(EngineArgs) if f.metadata.get("secret")]
    assert secrets == ["api_key"]
    public = args.public_dict()
    assert public["api_key"] == REDACTED and "sk-very-secret" not in repr(args)
    assert "sk-very-secret" not in str(public) and args.to_dict()["api_key"] == "sk-very-secret"
    assert EngineArgs().public_dict()["api_key"] is None  # unset shows as unset


def test_speculative_draft_shape_follows_the_device_unless_given():
    from phloem.runtime.scheduler.builder import speculative_shape

    eagle, ngram = EngineArgs(speculative_algorithm="EAGLE"), EngineArgs(speculative_algorithm="NGRAM")
    assert speculative_shape(eagle, "cuda") == (3, 4)  # a chain of 3
    assert speculative_shape(ngram, "cuda") == (3, 4)
    assert speculative_shape(eagle, "cpu") == (1, 2)  # a chain of 1: verified rows cost more on the CPU
    assert speculative_shape(ngram, "cpu") == (1, 3)  # 2 drafts
    given = EngineArgs(speculative_algorithm="EAGLE", speculative_num_steps=4, speculative_num_draft_tokens=5)
    assert speculative_shape(given, "cpu") == (4, 5)
    assert speculative_shape(EngineArgs(speculative_algorithm="EAGLE", speculative_num_steps=2), "cpu") == (2, 3)
