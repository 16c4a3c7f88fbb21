"""The Engine on the default model: output shape, prefix cache, streaming, aborts, sampling."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from phloem.runtime.errors import InvalidRequest

from .conftest import pool_is_idle

GREEDY = {"temperature": 0, "max_new_tokens": 8}


def test_generate_names_paris_and_meta_info_is_complete(engine):
    out = engine.generate("The capital of France is", sampling_params=GREEDY)
    assert "Paris" in out["text"]
    meta = out["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                "num_retractions", "e2e_latency"):
        assert key in meta
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 8
    assert meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0


def test_batch_and_n_return_lists(engine):
    outs = engine.generate(["One, two,", "A, B,"], sampling_params=GREEDY)
    assert isinstance(outs, list) and len(outs) == 2
    many = engine.generate("Roses are", sampling_params={"max_new_tokens": 4, "n": 3, "temperature": 1.0})
    assert isinstance(many, list) and len(many) == 3
    assert all(o["meta_info"]["completion_tokens"] == 4 for o in many)


def test_a_batch_submitted_at_once_is_prefilled_in_one_pass(engine):
    """The tokenizer manager sends the requests of one event-loop turn as one message, so the
    scheduler admits a list of prompts together rather than in whatever pieces its polls catch."""
    prompts = [f"Item {i}: a short line about the number {i}." for i in range(8)]
    for _ in range(3):
        before = engine.get_server_info()["live"]["prefill_batches_total"]
        outs = engine.generate(prompts, sampling_params={"temperature": 0, "max_new_tokens": 2})
        assert [o["meta_info"]["completion_tokens"] for o in outs] == [2] * len(prompts)
        assert engine.get_server_info()["live"]["prefill_batches_total"] - before == 1


def test_input_ids_and_text_agree(engine):
    ids = engine.tm.tokenizer.encode("The capital of France is", add_special_tokens=True)
    a = engine.generate(input_ids=ids, sampling_params=GREEDY)
    b = engine.generate("The capital of France is", sampling_params=GREEDY)
    assert a["output_ids"] == b["output_ids"]


def test_long_prompts_arriving_together_are_encoded_in_one_batch_with_the_same_ids(engine):
    """Texts past the inline limit go through the tokenizer manager's batch encoder (a worker
    thread); the ids, and so the outputs, are those of the plain encoder."""
    topics = ["rivers of Europe", "the history of printing", "how bees build combs", "tidal energy"]
    texts = [f"Write a short note about {t}. " + " ".join(f"Point {i}: {t} matters." for i in range(120)) for t in topics]
    assert all(len(t) > 2048 for t in texts)
    before = engine.tm._encoder.batches
    outs = engine.generate(texts, sampling_params=GREEDY)
    assert engine.tm._encoder.batches > before
    for text, out in zip(texts, outs, strict=True):
        ids = engine.tm.tokenizer.encode(text, add_special_tokens=True)
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["output_ids"] == engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]


def test_shared_prefix_is_computed_once(engine):
    engine.flush_cache()
    stem = " ".join(f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(80))
    ids = engine.tm.tokenizer.encode(stem)
    assert len(ids) >= 1000
    first = engine.generate(stem + " Question 0?", sampling_params={"max_new_tokens": 2})
    assert first["meta_info"]["cached_tokens"] == 0
    outs = engine.generate([stem + f" Question {i}?" for i in range(1, 16)], sampling_params={"max_new_tokens": 2})
    assert all(o["meta_info"]["cached_tokens"] >= 990 for o in outs), [o["meta_info"]["cached_tokens"] for o in outs]


def test_streaming_chunks_are_cumulative_and_end_with_finish(engine):
    chunks = list(engine.generate("Count: 1, 2, 3,", sampling_params={"max_new_tokens": 10, "temperature": 0}, stream=True))
    assert len(chunks) >= 2
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    full = engine.generate("Count: 1, 2, 3,", sampling_params={"max_new_tokens": 10, "temperature": 0})
    assert chunks[-1]["text"] == full["text"]


def test_stop_string_is_trimmed_and_reported(engine):
    base = engine.generate("Count: 1, 2, 3,", sampling_params={"max_new_tokens": 12, "temperature": 0})
    assert " 5" in base["text"]
    out = engine.generate("Count: 1, 2, 3,", sampling_params={"max_new_tokens": 12, "temperature": 0, "stop": " 5"})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 5"}
    assert out["text"] == base["text"][: base["text"].index(" 5")]
    kept = engine.generate("Count: 1, 2, 3,", sampling_params={"max_new_tokens": 12, "temperature": 0, "stop": " 5", "no_stop_trim": True})
    assert kept["text"].endswith(" 5")


def test_prefill_only_and_logprobs(engine):
    out = engine.generate("The capital of France is", sampling_params={"max_new_tokens": 0},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["finish_reason"]["type"] == "length"
    lps = meta["input_token_logprobs"]
    assert len(lps) == meta["prompt_tokens"] and lps[0][0] is None
    assert all(lp[0] <= 0 for lp in lps[1:])
    gen = engine.generate("The capital of France is", sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3,
                          return_text_in_logprobs=True)
    olp = gen["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in olp] == gen["output_ids"]
    tops = gen["meta_info"]["output_top_logprobs"]
    # greedy: the sampled token is the top-1 token
    assert all(top[0][1] == tok for top, tok in zip(tops, gen["output_ids"]))
    assert isinstance(olp[0][2], str)


def test_seeded_sampling_is_reproducible(engine):
    p = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 1234}
    a = engine.generate("Once upon a time", sampling_params=p)
    b = engine.generate("Once upon a time", sampling_params=p)
    assert a["output_ids"] == b["output_ids"]


def test_bad_input_raises_invalid_request(engine):
    with pytest.raises(InvalidRequest):
        engine.generate("x", sampling_params={"temperature": -1})
    with pytest.raises(InvalidRequest):
        engine.generate("x", sampling_params={"bogus": 1})
    with pytest.raises(InvalidRequest):
        engine.generate(input_ids=[10**9])
    with pytest.raises(InvalidRequest):
        engine.generate("x " * 9000)


def test_duplicate_rids_are_refused_as_the_http_route_refuses_them(engine):
    """The Engine expands a call with the route's code: a duplicate rid (given, or made by ``n``)
    is refused before any request starts, with the message ``/generate`` answers 400 with."""
    with pytest.raises(InvalidRequest) as err:
        engine.generate(["One,", "Two,"], rid=["twin", "twin"], sampling_params=GREEDY)
    assert (err.value.field, str(err.value)) == ("rid", "rid: duplicate request id 'twin'")
    with pytest.raises(InvalidRequest) as err:
        engine.generate(["One,", "Two,"], rid=["twin", "twin-0"], sampling_params=[{**GREEDY, "n": 2}, GREEDY])
    assert str(err.value) == "rid: duplicate request id 'twin-0'"
    out = engine.generate("One,", rid="twin", sampling_params=GREEDY)  # nothing of the refused calls runs
    assert out["meta_info"]["id"] == "twin"


def test_abort_streaming_request_frees_its_slots(engine):
    engine.flush_cache()
    stream = engine.generate("Write a long story about a dragon.", sampling_params={"max_new_tokens": 400, "ignore_eos": True},
                             stream=True, rid="to-abort")
    got = 0
    for chunk in stream:
        got += 1
        if got == 3:
            engine.abort("to-abort")
        if chunk["meta_info"]["finish_reason"] is not None:
            assert chunk["meta_info"]["finish_reason"]["type"] == "abort"
            break
    assert chunk["meta_info"]["completion_tokens"] < 400
    deadline = time.time() + 10
    while not pool_is_idle(engine.get_server_info()) and time.time() < deadline:
        time.sleep(0.1)
    info = engine.get_server_info()
    assert info["live"]["num_running_reqs"] == 0
    assert engine.flush_cache()
    assert pool_is_idle(engine.get_server_info())


def test_async_generate_and_async_stream(engine):
    async def main():
        out = await engine.async_generate("Hello", sampling_params={"max_new_tokens": 3})
        chunks = [c async for c in await engine.async_generate("Hello", sampling_params={"max_new_tokens": 3}, stream=True)]
        return out, chunks

    out, chunks = asyncio.run(main())
    assert out["meta_info"]["completion_tokens"] == 3
    assert chunks[-1]["meta_info"]["completion_tokens"] == 3


def test_many_random_requests_with_aborts_leave_pool_intact(engine):
    rng = random.Random(0)
    words = "the a dragon castle river code python seven blue quick lazy fox jumps over".split()

    async def one(i: int):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        params = {
            "max_new_tokens": rng.randint(0, 10),
            "temperature": rng.choice([0, 0.7, 1.0]),
            "top_p": rng.choice([1.0, 0.9]),
            "top_k": rng.choice([-1, 5, 50]),
            "min_p": rng.choice([0.0, 0.05]),
            "frequency_penalty": rng.choice([0.0, 0.5]),
            "repetition_penalty": rng.choice([1.0, 1.2]),
        }
        stream = await engine.async_generate(prompt, sampling_params=params, stream=True, rid=f"rand-{i}")
        abort_after = 2 if rng.random() < 0.1 else None
        n = 0
        last = None
        async for chunk in stream:
            last = chunk
            n += 1
            if abort_after is not None and n == abort_after:
                engine.abort(f"rand-{i}")
        return params, last, abort_after

    async def main():
        return await asyncio.gather(*(one(i) for i in range(300)))

    results = asyncio.run(main())
    for params, last, aborted in results:
        reason = last["meta_info"]["finish_reason"]
        if aborted is None:
            assert reason["type"] in ("length", "stop"), reason
            if reason["type"] == "length":
                assert last["meta_info"]["completion_tokens"] == params["max_new_tokens"]
    deadline = time.time() + 10
    while not pool_is_idle(engine.get_server_info()) and time.time() < deadline:
        engine.flush_cache()
        time.sleep(0.1)
    assert engine.flush_cache()
    assert pool_is_idle(engine.get_server_info())


def test_streamed_text_never_shows_the_stop_string(engine):
    params = {"max_new_tokens": 12, "temperature": 0, "stop": " 5"}
    full = engine.generate("Count: 1, 2, 3,", sampling_params=params)
    chunks = list(engine.generate("Count: 1, 2, 3,", sampling_params=params, stream=True))
    assert all(" 5" not in c["text"] for c in chunks)
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 5"}


def test_seeded_n_samples_differ_but_reproduce(engine):
    p = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7, "n": 3}
    a = engine.generate("My favourite animal is", sampling_params=p)
    b = engine.generate("My favourite animal is", sampling_params=p)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert len({tuple(o["output_ids"]) for o in a}) > 1


def test_scheduler_froze_its_startup_heap(engine):
    """The scheduler process takes its start-up objects out of the cyclic collector's reach, so a
    full collection does not stall every running request (the default model: ~175k objects)."""
    assert engine.get_server_info()["gc_frozen_objects"] > 10_000


def test_warmup_before_ready_leaves_no_trace(engine):
    """``--warmup on`` (the CUDA default) runs synthetic requests before the engine is ready; what
    a client sees afterwards is what an engine without it gives."""
    from phloem import Engine

    warm = Engine(log_level="warning", warmup="on")
    try:
        info = warm.get_server_info()
        assert info["warmup_requests"] >= 3 and info["warmup_prompt_tokens"] > info["chunked_prefill_size"]
        assert pool_is_idle(info) and info["live"]["prompt_tokens_total"] == 0
        prompts = ["The capital of France is", "def fibonacci(n):"]
        seeded = {"temperature": 0.8, "max_new_tokens": 8, "sampling_seed": 7}
        for params in (GREEDY, seeded):
            got = warm.generate(prompts, sampling_params=params)
            want = engine.generate(prompts, sampling_params=params)
            assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        assert "warmup_requests" not in engine.get_server_info()  # off on the CPU by default
    finally:
        warm.shutdown()


def test_loop_trace_records_the_engines_steps(tmp_path, monkeypatch):
    """``PHLOEM_LOOP_TRACE``: the scheduler process (started after the variable is set) writes a
    line per busy iteration: the prompt's prefill, then its decode steps, with host times."""
    from phloem import Engine

    path = tmp_path / "loop.txt"
    monkeypatch.setenv("PHLOEM_LOOP_TRACE", str(path))
    with Engine(log_level="warning", warmup="off") as eng:
        out = eng.generate("The capital of France is", sampling_params=GREEDY)
    assert out["meta_info"]["completion_tokens"] == 8
    header, *rows = path.read_text().splitlines()
    assert header.split()[:4] == ["t_ms", "recv_ms", "msgs", "kind"]
    kinds = [r.split()[3] for r in rows]
    assert "EXTEND" in kinds and kinds.count("DECODE") >= 7  # the first token comes from the prefill
    first = rows[kinds.index("EXTEND")].split()
    assert first[4] == "1" and all(float(x) >= 0 for x in first[5:])


def test_server_info_names_the_model_files_and_the_internal_states(engine):
    """``model_path`` is the file the default model came from (the flag was empty), and
    ``internal_states`` carries the figures SGLang's clients read there."""
    from phloem.runtime.model_files import default_model_path

    info = engine.get_server_info()
    assert info["model_path"] == default_model_path()
    (state,) = info["internal_states"]
    assert state["avg_spec_accept_length"] == 0.0  # no speculation
    assert state["last_gen_throughput"] >= 0.0
