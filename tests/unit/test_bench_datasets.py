"""Benchmark workloads: seeded, deterministic, and exactly the token lengths asked for."""

from __future__ import annotations

import dataclasses

import pytest
from phloem.bench.datasets import (
    AGENT_SYSTEM,
    DATASETS,
    SHORTEST_DATE,
    SHORTEST_RECORD,
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


@pytest.mark.parametrize("ratio", [1.0, 0.5])
@pytest.mark.parametrize("name", ["json-schema", "regex"])
def test_constrained_datasets_have_random_lengths(tok, name, ratio):
    """Same seed and flags: each prompt has the token count of ``random``'s, and asks for the same
    output length, so output tok/s of the three compare."""
    opt = dataclasses.replace(SMALL, random_input_len=64, random_output_len=90, random_range_ratio=ratio)
    plain, constrained = build_dataset("random", tok, opt), build_dataset(name, tok, opt)
    assert len(constrained) == opt.num_prompts
    for p, c in zip(plain, constrained):
        (pt,), (ct,) = p.turns, c.turns
        assert len(tok.encode(ct.content)) == len(tok.encode(pt.content))
        assert ct.output_len == pt.output_len and ct.constrained and not pt.constrained
        assert (ct.json_schema is not None) == (name == "json-schema") and (ct.regex is not None) == (
            name == "regex"
        )
    assert len({len(tok.encode(s.turns[0].content)) for s in constrained}) > (1 if ratio < 1 else 0)


def test_constrained_grammars_cannot_finish_within_the_output_length(tok):
    """The shortest document each grammar accepts has more tokens than the turn may produce, so
    every reply runs to its length (and the turns are sent with ignore_eos, like random's)."""
    opt = dataclasses.replace(SMALL, random_output_len=200)
    (js, *_), (rx, *_) = build_dataset("json-schema", tok, opt), build_dataset("regex", tok, opt)
    turn = js.turns[0]
    assert turn.json_schema is not None
    shortest = "[" + ",".join([SHORTEST_RECORD] * turn.json_schema["minItems"]) + "]"
    assert len(tok.encode(shortest)) > 2 * turn.output_len
    assert rx.turns[0].regex is not None
    count = int(rx.turns[0].regex.split("{")[1].split(",")[0])
    assert len(tok.encode(SHORTEST_DATE * (count + 1))) > 2 * rx.turns[0].output_len
    for session in (js, rx):
        req = prepare(session, 0, History.start(session), tok, ignore_eos=True)
        assert req.ignore_eos is True and req.messages is None
        assert (req.json_schema, req.regex) == (session.turns[0].json_schema, session.turns[0].regex)


def test_constrained_prompt_shorter_than_its_instruction_is_refused(tok):
    with pytest.raises(ValueError, match="--random-input-len must exceed the instruction"):
        build_dataset("json-schema", tok, dataclasses.replace(SMALL, random_input_len=5))


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
