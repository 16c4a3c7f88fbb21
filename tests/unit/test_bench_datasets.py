"""Benchmark workloads: seeded, deterministic, and exactly the token lengths asked for."""

from __future__ import annotations

import dataclasses

import pytest
from phloem.bench.datasets import (
    AGENT_SYSTEM,
    DATASETS,
    DatasetOptions,
    History,
    TextMaker,
    build_dataset,
    warmup_sessions,
)
from phloem.bench.runner import arrival_delays, prepare


@pytest.fixture(scope="module")
def tok():
    from phloem.runtime.model_files import resolve_model
    from phloem.runtime.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


SMALL = DatasetOptions(
    num_prompts=5,
    random_input_len=40,
    random_output_len=7,
    num_groups=3,
    prompts_per_group=4,
    prefix_len=100,
    question_len=12,
    output_len=5,
    num_conversations=2,
    num_turns=3,
    turn_len=20,
    system_len=10,
    num_agents=2,
    num_steps=3,
    task_len=10,
    tool_result_len=15,
    agent_output_len=6,
    json_input_len=30,
    json_output_len=50,
)


@pytest.mark.parametrize("name", list(DATASETS))
def test_same_seed_same_sessions(tok, name):
    assert build_dataset(name, tok, SMALL) == build_dataset(name, tok, SMALL)


@pytest.mark.parametrize("name", list(DATASETS))
def test_other_seed_other_sessions(tok, name):
    other = dataclasses.replace(SMALL, seed=1)
    assert build_dataset(name, tok, SMALL) != build_dataset(name, tok, other)


@pytest.mark.parametrize("n", [1, 2, 17, 300])
def test_text_maker_hits_token_count(tok, n):
    import random

    maker = TextMaker(tok)
    rng = random.Random(n)
    assert len(tok.encode(maker.make(n, rng))) == n
    assert len(tok.encode("x" + maker.make(n, rng, lead_space=True))) == n + 1


def test_random_fixed_lengths(tok):
    sessions = build_dataset("random", tok, SMALL)
    assert len(sessions) == SMALL.num_prompts
    for s in sessions:
        (turn,) = s.turns
        assert not s.chat and len(tok.encode(turn.content)) == 40 and turn.output_len == 7


def test_random_uniform_lengths_within_range(tok):
    opt = dataclasses.replace(SMALL, num_prompts=40, random_range_ratio=0.5)
    sessions = build_dataset("random", tok, opt)
    ins = [len(tok.encode(s.turns[0].content)) for s in sessions]
    outs = [s.turns[0].output_len for s in sessions]
    assert all(20 <= n <= 40 for n in ins) and len(set(ins)) > 5
    assert all(3 <= n <= 7 for n in outs)


def test_shared_prefix_groups_share_exact_token_prefix(tok):
    sessions = build_dataset("shared-prefix", tok, SMALL)
    assert len(sessions) == 12
    ids = [tok.encode(s.turns[0].content) for s in sessions]
    assert all(len(x) == 112 for x in ids)
    for g in range(3):
        group = ids[4 * g : 4 * g + 4]
        assert all(x[:100] == group[0][:100] for x in group)
        assert len({tuple(x[100:]) for x in group}) == 4
    assert ids[0][:100] != ids[4][:100]


def test_shared_prefix_shuffle_is_a_permutation(tok):
    plain = build_dataset("shared-prefix", tok, SMALL)
    mixed = build_dataset("shared-prefix", tok, dataclasses.replace(SMALL, shuffle=True))
    assert sorted(s.turns[0].content for s in plain) == sorted(s.turns[0].content for s in mixed)
    assert [s.sid for s in mixed] != sorted(s.sid for s in mixed)


def test_multi_turn_history_grows(tok):
    (s, _) = build_dataset("multi-turn", tok, SMALL)
    assert s.chat and len(s.turns) == 3
    assert all(len(tok.encode(t.content)) == 20 for t in s.turns)
    history = History.start(s)
    lens = []
    for i, turn in enumerate(s.turns):
        req = prepare(s, i, history, tok, ignore_eos=True)
        lens.append(req.prompt_len)
        assert req.messages is not None and req.messages[0]["role"] == "system"
        assert req.text == tok.apply_chat_template(req.messages)
        history.add(turn.content, "a short reply")
    assert lens[0] < lens[1] < lens[2]


def test_agent_sessions_share_system_prompt(tok):
    sessions = build_dataset("agent", tok, SMALL)
    assert len(sessions) == 2 and all(s.system == AGENT_SYSTEM for s in sessions)
    assert all(len(s.turns) == 3 and all(t.output_len == 6 for t in s.turns) for s in sessions)
    assert sessions[0].turns[1].content.startswith("Observation from ")


def test_json_schema_turns_carry_schema_and_no_ignore_eos(tok):
    sessions = build_dataset("json-schema", tok, SMALL)
    assert all(s.turns[0].json_schema for s in sessions)
    req = prepare(sessions[0], 0, History.start(sessions[0]), tok, ignore_eos=True)
    assert req.json_schema is not None and req.ignore_eos is False and req.messages is None


def test_warmup_prompts_differ_from_datasets(tok):
    warm = {s.turns[0].content for s in warmup_sessions(tok, 3)}
    data = {s.turns[0].content for s in build_dataset("random", tok, SMALL)}
    assert len(warm) == 3 and not warm & data


def test_unknown_dataset(tok):
    with pytest.raises(ValueError, match="unknown dataset"):
        build_dataset("nope", tok, SMALL)


def test_poisson_arrivals_seeded_and_increasing():
    a = arrival_delays(50, 4.0, seed=3)
    assert a == arrival_delays(50, 4.0, seed=3) and a != arrival_delays(50, 4.0, seed=4)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert 6 < a[-1] < 20  # 49 gaps of mean 0.25 s
    assert arrival_delays(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]
