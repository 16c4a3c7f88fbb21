"""Seeded, deterministic benchmark workloads.

A workload is a list of :class:`Session` objects. A session is one conversation: its turns run one
after another (a turn's prompt holds the replies the server gave to the turns before it), while
different sessions run concurrently. Single-prompt datasets (``random``, ``shared-prefix``,
``json-schema``) are sessions of one raw-text turn.

Prompts are made of real words whose token counts are known, so a prompt of ``n`` tokens has exactly
``n`` tokens under the benchmark's tokenizer (:class:`TextMaker` checks this). The same
``(dataset, options, seed)`` always gives the same sessions.

Datasets
--------
random          ``num_prompts`` raw prompts; lengths fixed or uniform (``range_ratio`` < 1).
shared-prefix   ``num_groups`` x ``prompts_per_group`` raw prompts; each group shares one
                ``prefix_len``-token system prompt, followed by a ``question_len``-token question.
multi-turn      ``num_conversations`` chats of ``num_turns`` user turns; each turn resends the history.
agent           ``num_agents`` tool-using loops: one fixed system prompt with a tool list, a task,
                then ``num_steps`` observations appended to a growing history; short outputs.
json-schema     ``random``'s prompts and lengths, each reply constrained by a JSON schema (a list
                of records too long to finish within the output length).
regex           the same with a regex (a list of dates too long to finish).

``json-schema`` and ``regex`` draw their lengths exactly as ``random`` does, so for one seed the
three send the same number of prompt tokens and ask for the same output lengths; their grammars
need more tokens than ``random_output_len`` to complete, so every reply runs to its length (cut
short, like ``random``'s with ``ignore_eos``) and output tokens/s compare like with like.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


@dataclass(frozen=True)
class Turn:
    """One request of a session.

    ``content`` is the whole prompt for a raw session, or the user message for a chat session.
    """

    content: str
    output_len: int
    json_schema: dict[str, Any] | None = None
    regex: str | None = None

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None or self.regex is not None


@dataclass(frozen=True)
class Session:
    """A conversation: turns run in order; ``chat`` sessions render history with a chat template."""

    sid: int
    turns: tuple[Turn, ...]
    chat: bool = False
    system: str | None = None

    @property
    def num_requests(self) -> int:
        return len(self.turns)


@dataclass(frozen=True)
class DatasetOptions:
    """Sizes for every dataset (each dataset reads the fields it needs)."""

    seed: int = 0
    num_prompts: int = 16
    # random
    random_input_len: int = 128
    random_output_len: int = 32
    random_range_ratio: float = 1.0  # 1.0 = fixed lengths; r < 1 = uniform in [len * r, len]
    # shared-prefix
    num_groups: int = 4
    prompts_per_group: int = 4
    prefix_len: int = 512
    question_len: int = 32
    output_len: int = 32
    shuffle: bool = False
    # multi-turn
    num_conversations: int = 4
    num_turns: int = 3
    turn_len: int = 48
    system_len: int = 64
    # agent
    num_agents: int = 4
    num_steps: int = 4
    task_len: int = 48
    tool_result_len: int = 64
    agent_output_len: int = 24


# Common English words; those that are one token (with and without a leading space) under the
# benchmark's tokenizer make up prompts, so token counts add up word by word.
WORDS = """
the of and to in is was for on that with as by at from his her they this have had not are but
which one were all she their there been has when who will more no if out so said what up its about
into than them can only other new some time could these two may then do first any like now my such
make over our even most made after also did many before must through back years where much your way
well down should because each just those people how too little state good very world still own see
men work long here get both between life being under never day same another know while last might
great old year off come since against go came right used take three small house water city power
river market music garden table window light paper story green blue stone night morning summer
winter field road ship train letter money family friend country school company system program
question number point group hand part child eye place week case report order line plan area book
study office game price door food head voice field level model result reason change service data
""".split()


class TextMaker:
    """Builds text with an exact token count from words that are single tokens.

    Parameters
    ----------
    tokenizer:
        Anything with ``encode(text) -> list[int]``.
    words:
        Candidate words; only those encoding to one token both alone and after a space are kept.
    """

    def __init__(self, tokenizer: TokenizerLike, words: Sequence[str] = WORDS) -> None:
        self.tokenizer = tokenizer
        self.words = sorted({w for w in words if self._single(w)})
        if len(self.words) < 32:
            raise ValueError(f"only {len(self.words)} single-token words for this tokenizer")

    def _single(self, word: str) -> bool:
        return len(self.tokenizer.encode(word)) == 1 and len(self.tokenizer.encode(" " + word)) == 1

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def make(self, n_tokens: int, rng: random.Random, *, lead_space: bool = False) -> str:
        """Text of exactly ``n_tokens`` tokens (``lead_space``: starts with a space, for appending)."""
        if n_tokens <= 0:
            return ""
        picked = [rng.choice(self.words) for _ in range(n_tokens)]
        text = (" " if lead_space else "") + " ".join(picked)
        got = self.count(text)
        if got != n_tokens:
            raise ValueError(f"built {got} tokens for a target of {n_tokens}; this tokenizer merges words")
        return text


def _length(rng: random.Random, full: int, ratio: float) -> int:
    if ratio >= 1.0:
        return full
    return rng.randint(max(1, int(full * ratio)), full)


# ---- random ----------------------------------------------------------------------------------------
def random_dataset(maker: TextMaker, opt: DatasetOptions) -> list[Session]:
    rng = random.Random(opt.seed)
    sessions = []
    for i in range(opt.num_prompts):
        n_in = _length(rng, opt.random_input_len, opt.random_range_ratio)
        n_out = _length(rng, opt.random_output_len, opt.random_range_ratio)
        sessions.append(Session(i, (Turn(maker.make(n_in, rng), n_out),)))
    return sessions


# ---- shared prefix ---------------------------------------------------------------------------------
def shared_prefix_dataset(maker: TextMaker, opt: DatasetOptions) -> list[Session]:
    """Groups of prompts ``prefix + question``; the prefix's tokens are identical within a group."""
    rng = random.Random(opt.seed)
    sessions: list[Session] = []
    for _ in range(opt.num_groups):
        prefix = maker.make(opt.prefix_len, rng)
        for _ in range(opt.prompts_per_group):
            text = prefix + maker.make(opt.question_len, rng, lead_space=True)
            sessions.append(Session(len(sessions), (Turn(text, opt.output_len),)))
    if opt.shuffle:
        random.Random(opt.seed + 1).shuffle(sessions)
    return sessions


# ---- multi-turn chat -------------------------------------------------------------------------------
def multi_turn_dataset(maker: TextMaker, opt: DatasetOptions) -> list[Session]:
    rng = random.Random(opt.seed)
    sessions = []
    for c in range(opt.num_conversations):
        system = "You are a helpful assistant. " + maker.make(opt.system_len, rng)
        turns = tuple(Turn(maker.make(opt.turn_len, rng), opt.output_len) for _ in range(opt.num_turns))
        sessions.append(Session(c, turns, chat=True, system=system))
    return sessions


# ---- agent loop ------------------------------------------------------------------------------------
AGENT_TOOLS: list[dict[str, Any]] = [
    {
        "name": "search",
        "description": "Search the web and return the top results.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
    {
        "name": "read_file",
        "description": "Read a file from the workspace.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
    {
        "name": "run_python",
        "description": "Run a Python snippet and return its output.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
]

AGENT_SYSTEM = (
    "You are an agent that solves tasks step by step. At each step, either call one tool by "
    'answering with a JSON object {"tool": name, "arguments": {...}}, or give the final answer. '
    "Available tools:\n" + "\n".join(json.dumps(t, sort_keys=True) for t in AGENT_TOOLS)
)


def agent_dataset(maker: TextMaker, opt: DatasetOptions) -> list[Session]:
    """The same system prompt and tool list for every agent; each step adds an observation."""
    rng = random.Random(opt.seed)
    sessions = []
    for a in range(opt.num_agents):
        turns = [Turn("Task: " + maker.make(opt.task_len, rng), opt.agent_output_len)]
        for s in range(opt.num_steps - 1):
            tool = AGENT_TOOLS[(a + s) % len(AGENT_TOOLS)]["name"]
            observation = f"Observation from {tool}: " + maker.make(opt.tool_result_len, rng)
            turns.append(Turn(observation, opt.agent_output_len))
        sessions.append(Session(a, tuple(turns), chat=True, system=AGENT_SYSTEM))
    return sessions


# ---- constrained: JSON schema, regex ---------------------------------------------------------------
# Regular, with a small token automaton (names are capitalized words, no numeric bounds), so a GPU
# server masks it on the device (docs/structured-output.md) like any everyday extraction schema.
RECORD: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "year": {"type": "integer"},
    },
    "required": ["name", "city", "year"],
    "additionalProperties": False,
}
# The fewest characters a record can take (compact JSON, empty strings): what it costs at least.
SHORTEST_RECORD = '{"name":"Ab","city":"Ab","year":0}'
JSON_INSTRUCTION = "JSON records (name, city, year) of the people in:"

DATE = r"(19|20)\d\d-[01]\d-[0-3]\d"
SHORTEST_DATE = "1900-01-01, "
REGEX_INSTRUCTION = "The dates (YYYY-MM-DD) in:"


def units_needed(tokenizer: TokenizerLike, shortest: str, output_len: int) -> int:
    """How many repeated units (records, dates) a grammar must ask for so no reply completes within
    ``output_len`` tokens. A model may spell a unit in fewer tokens than the tokenizer's own encoding
    of it, so the count is doubled; extra units cost nothing, the reply is cut at ``output_len``."""
    per_unit = max(1, len(tokenizer.encode(shortest)))
    return 2 * (output_len // per_unit + 1)


def records_schema(count: int) -> dict[str, Any]:
    """A JSON array of at least ``count`` records."""
    return {"type": "array", "items": RECORD, "minItems": count}


def dates_regex(count: int) -> str:
    """At least ``count`` comma-separated dates."""
    return f"({DATE}, ){{{count},}}{DATE}"


def _instructed(maker: TextMaker, sessions: list[Session], instruction: str) -> list[tuple[str, int]]:
    """Each one-turn session's prompt with ``instruction`` in place of its first words, the token
    count unchanged; with its output length."""
    head = maker.count(instruction)
    out = []
    for s in sessions:
        (turn,) = s.turns
        words = turn.content.split(" ")
        if len(words) <= head:
            raise ValueError(
                f"--random-input-len must exceed the instruction's {head} tokens (got {len(words)})"
            )
        text = instruction + " " + " ".join(words[head:])
        if maker.count(text) != len(words):
            raise ValueError(f"built {maker.count(text)} tokens for a target of {len(words)}")
        out.append((text, turn.output_len))
    return out


def json_schema_dataset(maker: TextMaker, opt: DatasetOptions) -> list[Session]:
    """``random``'s sessions asking for JSON records; ``json_schema`` constrains each reply."""
    prompts = _instructed(maker, random_dataset(maker, opt), JSON_INSTRUCTION)
    return [
        Session(
            i, (Turn(text, n, json_schema=records_schema(units_needed(maker.tokenizer, SHORTEST_RECORD, n))),)
        )
        for i, (text, n) in enumerate(prompts)
    ]


def regex_dataset(maker: TextMaker, opt: DatasetOptions) -> list[Session]:
    """``random``'s sessions asking for dates; ``regex`` constrains each reply."""
    prompts = _instructed(maker, random_dataset(maker, opt), REGEX_INSTRUCTION)
    return [
        Session(i, (Turn(text, n, regex=dates_regex(units_needed(maker.tokenizer, SHORTEST_DATE, n))),))
        for i, (text, n) in enumerate(prompts)
    ]


DATASETS: dict[str, Callable[[TextMaker, DatasetOptions], list[Session]]] = {
    "random": random_dataset,
    "shared-prefix": shared_prefix_dataset,
    "multi-turn": multi_turn_dataset,
    "agent": agent_dataset,
    "json-schema": json_schema_dataset,
    "regex": regex_dataset,
}


def build_dataset(name: str, tokenizer: TokenizerLike, opt: DatasetOptions) -> list[Session]:
    """The sessions of dataset ``name`` (a key of ``DATASETS``)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    return DATASETS[name](TextMaker(tokenizer), opt)


def warmup_sessions(tokenizer: TokenizerLike, count: int, *, seed: int = 10_007) -> list[Session]:
    """Short raw prompts, disjoint from the datasets' seeds, to warm a server up."""
    opt = DatasetOptions(seed=seed, num_prompts=count, random_input_len=16, random_output_len=4)
    return random_dataset(TextMaker(tokenizer), opt)


@dataclass
class History:
    """The messages of a chat session so far (system first)."""

    messages: list[dict[str, str]] = field(default_factory=list)

    @classmethod
    def start(cls, session: Session) -> History:
        return cls([{"role": "system", "content": session.system}] if session.system else [])

    def with_user(self, content: str) -> list[dict[str, str]]:
        return [*self.messages, {"role": "user", "content": content}]

    def add(self, user: str, assistant: str) -> None:
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
