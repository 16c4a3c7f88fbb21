"""The program IR: frozen, keyword-only nodes that a program appends to its state.

The IR says *what* a program asks for (text, a generation, a choice, a role boundary); it knows no wire
format. Backends map a resolved :class:`SamplingParams` and :class:`Constraint` onto their own requests.

Nodes compose with ``+``: ``"Q: " + gen("a")`` is a :class:`Seq`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

Role = Literal["system", "user", "assistant"]
ROLES: tuple[str, ...] = ("system", "user", "assistant")


def _as_node(value: Node | str) -> Node:
    if isinstance(value, Node):
        return value
    if isinstance(value, str):
        return Text(value=value)
    raise TypeError(f"cannot add {type(value).__name__} to a program; use a str or a phloem node")


@dataclass(frozen=True, kw_only=True)
class Node:
    """Base of every IR node. ``a + b`` concatenates nodes (and plain strings) into a :class:`Seq`."""

    def __add__(self, other: Node | str) -> Seq:
        return Seq.of(self, _as_node(other))

    def __radd__(self, other: Node | str) -> Seq:
        return Seq.of(_as_node(other), self)


@dataclass(frozen=True, kw_only=True)
class Text(Node):
    """Constant text appended verbatim."""

    value: str


@dataclass(frozen=True, kw_only=True)
class Seq(Node):
    """Several nodes in order."""

    items: tuple[Node, ...]

    @staticmethod
    def of(*nodes: Node) -> Seq:
        flat: list[Node] = []
        for node in nodes:
            flat.extend(node.items if isinstance(node, Seq) else (node,))
        return Seq(items=tuple(flat))


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Sampling options of one generation; ``None`` means "inherit the program default, then the
    backend's". Names are the DSL's (``max_tokens``), not any wire format's."""

    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop_regex: tuple[str, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    n: int | None = None

    def merged_over(self, defaults: SamplingParams) -> SamplingParams:
        """Fill every unset field from ``defaults``."""
        missing = {f.name: getattr(defaults, f.name) for f in fields(self) if getattr(self, f.name) is None}
        return replace(self, **missing)

    def set_fields(self) -> dict[str, Any]:
        """The fields that are not ``None``, by DSL name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True, kw_only=True)
class Constraint:
    """A grammar the output must match. ``spec`` is a regex, a JSON schema as a JSON string, or EBNF."""

    kind: Literal["regex", "json_schema", "ebnf"]
    spec: str


@dataclass(frozen=True, kw_only=True)
class LogprobOptions:
    """What log probabilities a generation should return in its meta info."""

    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None


@dataclass(frozen=True, kw_only=True)
class Gen(Node):
    """Generate text; store it (converted by ``output_type``) under ``name``.

    ``output_type`` is ``None`` (store the text), ``int``/``float``/``bool``/``str`` (from ``dtype``),
    or a pydantic model class (from ``json_schema=Model``) whose parsed instance is stored.
    """

    name: str | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    constraint: Constraint | None = None
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    output_type: Any = None


@dataclass(frozen=True, kw_only=True)
class Select(Node):
    """Choose one of ``choices`` by scoring each with the model; store the chosen string.

    ``method`` is a :class:`phloem.lang.choices.ChoicesMethod`.
    """

    name: str | None
    choices: tuple[str, ...]
    temperature: float = 0.0
    method: Any = None


@dataclass(frozen=True, kw_only=True)
class RoleBegin(Node):
    """Open a chat role: appends the chat template's prefix for ``role``."""

    role: str


@dataclass(frozen=True, kw_only=True)
class RoleEnd(Node):
    """Close a chat role: appends the template's suffix and records a message."""

    role: str


@dataclass(frozen=True, kw_only=True)
class RoleBlock(Node):
    """A whole chat turn: ``RoleBegin``, the body, ``RoleEnd`` (the value form ``user("hi")``)."""

    role: str
    body: Node


@dataclass(frozen=True, kw_only=True)
class VarScopeBegin(Node):
    """Start capturing appended text into the variable ``name``."""

    name: str


@dataclass(frozen=True, kw_only=True)
class VarScopeEnd(Node):
    """Stop capturing; the variable ``name`` holds the text appended since the matching begin."""

    name: str


def as_node(value: Node | str) -> Node:
    """Coerce a string or node into a node."""
    return _as_node(value)
