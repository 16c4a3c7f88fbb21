"""Constrained decoding end to end on the default model, for every grammar backend.

One Engine per backend, and one batch per backend holding every case: the JSON-schema table of
``tests/grammars/test_json_schemas.py``, regexes, EBNF grammars, unconstrained prompts (so the batch
is mixed) and an ``n=2`` request. Decoding is greedy (the ``n=2`` request samples over a finite
language), and every cap is large enough for its grammar to terminate: a request that stops on
length is a failure, not a pass.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest

from ..grammars.test_json_schemas import SCHEMAS, UNSUPPORTED

pytestmark = pytest.mark.slow

BACKENDS = ("xgrammar", "llguidance", "outlines")
# grammar kind -> why outlines cannot serve it (its requests must abort cleanly instead)
OUTLINES_LACKS = {"ebnf": "outlines-core compiles regular languages only; EBNF needs a context-free parser"}

SCHEMA_CAP = 64
# Schemas whose output is longer than SCHEMA_CAP when the model fills them in.
SCHEMA_CAPS = {"array_of_objects": 80, "defs_ref": 80, "nested_object": 80, "recursive_ref": 96}

DEFAULT_QUESTION = "Give one short example JSON value for this JSON schema: {schema}\nReply with the JSON only."
# Unbounded grammars (numbers, recursion) end only when the model wants to stop: these prompts give
# the model a short answer to stop after; a conversation shows it one answer of the expected shape.
Conversation = list[tuple[str, str]]
QUESTIONS: dict[str, str | Conversation] = {
    "integer": "Pick a number between 1 and 10.",
    "any_of": "Pick a number between 1 and 10.",
    "number": "Pick a number between 1 and 10, like 2.5.",
    "number_bounds": [("user", "Pick a number between 0 and 1."), ("assistant", "0.5"), ("user", "Pick another one.")],
    "format_email": "Make up an email address like bob@example.com.",
    "recursive_ref": 'Write a linked list with one node of value 7 as JSON, like {"v": 1, "next": null}.',
    "tuple_prefix_items": "Reply with a JSON array of a word and a number between 1 and 10.",
}

REGEXES = {
    "phone": (r"\(\d{3}\) \d{3}-\d{4}", "Make up a US phone number for a pizza shop."),
    "iso_date": (r"20\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "What is a date in 2024? Use YYYY-MM-DD."),
    "yes_no_maybe": (r"(yes|no|maybe)", "Is the sky blue? Answer yes, no or maybe."),
    "capitalized_word": (r"[A-Z][a-z]{1,8}", "Name a fruit."),
    "clock_time": (r"([01]\d|2[0-3]):[0-5]\d", "What time is lunch? Use HH:MM."),
    "ipv4": (
        r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)",
        "What is the IP address of a home router?",
    ),
}
REGEX_CAP = 32

# A finite arithmetic language (so greedy decoding always ends), checked by ``parse_arith``.
ARITH_EBNF = r"""
root ::= expr
expr ::= term | term op term | term op term op term
term ::= num | "(" num op num ")"
num ::= [1-9] | [1-9] [0-9]
op ::= " + " | " - " | " * "
"""
GREETING_EBNF = r"""
root ::= salute ", " name "!"
salute ::= "Hello" | "Hi"
name ::= [A-Z] [a-z] [a-z]? [a-z]? [a-z]? [a-z]?
"""
GREETING_RE = r"(Hello|Hi), [A-Z][a-z]{1,5}!"
EBNFS = {
    "arith": (ARITH_EBNF, "Write a short arithmetic expression that equals 10."),
    "greeting": (GREETING_EBNF, "Greet a friend called Sam."),
}
EBNF_CAP = 32

UNCONSTRAINED = {
    "capital": "The capital of France is",
    "count": "Count: 1, 2, 3,",
}
UNCONSTRAINED_CAP = 12

# A finite language, so sampling at temperature 1 always terminates.
PAIR_SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
N_SAMPLES = 2


@dataclass
class Case:
    kind: str  # json_schema | regex | ebnf | none | n2
    name: str
    question: str | Conversation | None  # chat question or conversation; None for a raw prompt
    params: dict[str, Any]
    raw_prompt: str = ""


@dataclass
class BatchRun:
    """The outputs of one backend's batch, by (kind, name)."""

    backend: str
    outputs: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)
    alone: dict[str, dict[str, Any]] = field(default_factory=dict)

    def one(self, kind: str, name: str) -> dict[str, Any]:
        (out,) = self.outputs[kind, name]
        return out


def _greedy(cap: int, **grammar: str) -> dict[str, Any]:
    return {"max_new_tokens": cap, "temperature": 0, **grammar}


def build_cases(backend: str) -> list[Case]:
    cases = []
    for name, schema in sorted(SCHEMAS.items()):
        if (backend, name) in UNSUPPORTED:
            continue
        text = json.dumps(schema)
        question = QUESTIONS.get(name, DEFAULT_QUESTION.format(schema=text))
        cases.append(Case("json_schema", name, question, _greedy(SCHEMA_CAPS.get(name, SCHEMA_CAP), json_schema=text)))
    for name, (pattern, question) in REGEXES.items():
        cases.append(Case("regex", name, question, _greedy(REGEX_CAP, regex=pattern)))
    for name, (grammar, question) in EBNFS.items():
        cases.append(Case("ebnf", name, question, _greedy(EBNF_CAP, ebnf=grammar)))
    for name, prompt in UNCONSTRAINED.items():
        cases.append(Case("none", name, None, _greedy(UNCONSTRAINED_CAP), raw_prompt=prompt))
    pair = json.dumps(PAIR_SCHEMA)
    n2 = {"max_new_tokens": 32, "temperature": 1.0, "n": N_SAMPLES, "json_schema": pair}
    cases.append(Case("n2", "pair", DEFAULT_QUESTION.format(schema=pair), n2))
    return cases


def _chat_prompt(engine: Any, question: str | Conversation) -> str:
    turns = [("user", question)] if isinstance(question, str) else question
    messages = [{"role": role, "content": content} for role, content in turns]
    return engine.tm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


@pytest.fixture(scope="module", params=BACKENDS)
def run(request) -> BatchRun:
    from phloem import Engine

    backend = request.param
    engine = Engine(grammar_backend=backend, log_level="warning")
    try:
        result = BatchRun(backend)
        # Unconstrained references first, each alone, on an empty prefix cache.
        for name, prompt in UNCONSTRAINED.items():
            result.alone[name] = engine.generate(prompt, sampling_params=_greedy(UNCONSTRAINED_CAP))
        engine.flush_cache()
        cases = build_cases(backend)
        prompts = [c.raw_prompt if c.question is None else _chat_prompt(engine, c.question) for c in cases]
        outs = engine.generate(prompts, sampling_params=[c.params for c in cases])
        it = iter(outs)
        for c in cases:
            result.outputs[c.kind, c.name] = [next(it) for _ in range(c.params.get("n", 1))]
        yield result
    finally:
        engine.shutdown()


def _finished_text(out: dict[str, Any], what: str) -> str:
    """The output text; fails unless the grammar itself ended the request (stop, not length)."""
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "stop", f"{what}: did not terminate ({reason}); text {out['text']!r}"
    return out["text"]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_validates(run, name):
    if (run.backend, name) in UNSUPPORTED:
        pytest.skip(UNSUPPORTED[run.backend, name])
    text = _finished_text(run.one("json_schema", name), name)
    jsonschema.validate(json.loads(text), SCHEMAS[name])


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_regex_output_fullmatches(run, name):
    pattern = REGEXES[name][0]
    text = _finished_text(run.one("regex", name), name)
    assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern!r}"


@pytest.mark.parametrize("name", sorted(EBNFS))
def test_ebnf_output_parses(run, name):
    out = run.one("ebnf", name)
    if run.backend == "outlines":
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason.get("message"), reason
        pytest.skip(OUTLINES_LACKS["ebnf"])
    text = _finished_text(out, name)
    if name == "arith":
        assert parse_arith(text), f"{text!r} is not in the arithmetic grammar"
    else:
        assert re.fullmatch(GREETING_RE, text), f"{text!r} is not in the greeting grammar"


@pytest.mark.parametrize("name", sorted(UNCONSTRAINED))
def test_unconstrained_rows_of_mixed_batch_match_their_solo_run(run, name):
    mixed = run.one("none", name)
    alone = run.alone[name]
    assert mixed["meta_info"]["finish_reason"] == {"type": "length", "length": UNCONSTRAINED_CAP}
    assert mixed["output_ids"] == alone["output_ids"], (mixed["text"], alone["text"])


def test_n2_with_schema_gives_two_valid_samples(run):
    outs = run.outputs["n2", "pair"]
    assert len(outs) == N_SAMPLES
    for out in outs:
        jsonschema.validate(json.loads(_finished_text(out, "pair")), PAIR_SCHEMA)


def parse_arith(text: str) -> bool:
    """Recursive-descent check of ``ARITH_EBNF``: ``term (op term){0,2}``."""
    pos = 0

    def eat(literal: str) -> bool:
        nonlocal pos
        if text.startswith(literal, pos):
            pos += len(literal)
            return True
        return False

    def num() -> bool:
        nonlocal pos
        m = re.compile(r"[1-9][0-9]?").match(text, pos)
        if m is None:
            return False
        pos = m.end()
        return True

    def op() -> bool:
        return eat(" + ") or eat(" - ") or eat(" * ")

    def term() -> bool:
        if eat("("):
            return num() and op() and num() and eat(")")
        return num()

    if not term():
        return False
    for _ in range(2):
        if not op():
            break
        if not term():
            return False
    return pos == len(text)


def test_parse_arith_oracle():
    for good in ("7", "(3 + 4) * 2", "10 - 5 + 5", "(1 * 2) - (3 + 4)"):
        assert parse_arith(good), good
    for bad in ("", "0", "1 + 2 + 3 + 4", "(1 + 2", "1+2", "123", "(1 + (2 * 3))"):
        assert not parse_arith(bad), bad
