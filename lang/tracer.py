"""Tracing: run a program without a model to find its request tree.

A :class:`TracerState` accepts the same calls as a running program's state but sends nothing. Generated
values and arguments that were not given become placeholders (``{name}`` when printed). The result, a
:class:`RequestTree`, shows the constant stem (text that is the same whatever the model says, sent once
before a batch), the roles, every ``gen``/``select`` and every fork point.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from phloem.lang.chat_template import ChatTemplate
from phloem.lang.ir import (
    Gen,
    Node,
    RoleBegin,
    RoleBlock,
    RoleEnd,
    Select,
    Seq,
    Text,
    VarScopeBegin,
    VarScopeEnd,
    as_node,
)

_OPEN, _CLOSE = "\ue000", "\ue001"


class TracedValue(str):
    """A value unknown while tracing (a generated variable or a missing argument).

    It is a ``str`` so f-strings work; its characters mark where the text stops being constant.
    """

    def __new__(cls, name: str) -> TracedValue:
        value = super().__new__(cls, f"{_OPEN}{name}{_CLOSE}")
        value.name = name  # type: ignore[attr-defined]
        return value


def show(text: str) -> str:
    """Text with placeholders printed as ``{name}``."""
    return text.replace(_OPEN, "{").replace(_CLOSE, "}")


@dataclass(kw_only=True)
class TraceStep:
    """One step of a traced program. ``text`` is what the step appends (rendered role markers
    included); ``branches`` is set on fork steps."""

    kind: str
    label: str = ""
    text: str = ""
    branches: list[Branch] = field(default_factory=list)


@dataclass(kw_only=True)
class Branch:
    """A sequence of steps: the program itself or one fork branch."""

    steps: list[TraceStep] = field(default_factory=list)


@dataclass(kw_only=True)
class RequestTree:
    """The request tree of one traced program.

    ``stem`` is the constant text before the first generation, variable read, unknown argument or fork.
    """

    name: str
    root: Branch
    stem: str

    @property
    def fork_points(self) -> list[TraceStep]:
        """Every fork step, outermost first."""
        return [step for step, _ in _walk(self.root, 0) if step.kind == "fork"]

    @property
    def generations(self) -> list[TraceStep]:
        """Every ``gen`` and ``select`` step, in program order (branches depth first)."""
        return [step for step, _ in _walk(self.root, 0) if step.kind in ("gen", "select")]

    def __str__(self) -> str:
        lines = [
            f"request tree of {self.name}",
            f"stem ({len(self.stem)} chars, sent once): {_preview(self.stem)}",
        ]
        lines += _render(self.root, "")
        return "\n".join(lines)


def _walk(branch: Branch, depth: int) -> Iterator[tuple[TraceStep, int]]:
    for step in branch.steps:
        yield step, depth
        for child in step.branches:
            yield from _walk(child, depth + 1)


def _preview(text: str, limit: int = 72) -> str:
    text = show(text)
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _render(branch: Branch, indent: str) -> list[str]:
    lines = []
    for i, step in enumerate(branch.steps):
        last = i == len(branch.steps) - 1
        lines.append(f"{indent}{'└─' if last else '├─'} {_describe(step)}")
        inner = indent + ("   " if last else "│  ")
        for j, child in enumerate(step.branches):
            child_last = j == len(step.branches) - 1
            lines.append(f"{inner}{'└─' if child_last else '├─'} branch {j}")
            lines += _render(child, inner + ("   " if child_last else "│  "))
    return lines


def _describe(step: TraceStep) -> str:
    if step.kind == "text":
        return f"text {_preview(step.text)}"
    return f"{step.kind} {step.label}".rstrip()


# -- the tracing state -----------------------------------------------------------------------------------


class TracerState:
    """Stands in for :class:`~phloem.lang.interpreter.ProgramState` while tracing."""

    def __init__(self, *, template: ChatTemplate, text: str = "", branch: Branch | None = None):
        self._template = template
        self._text = text
        self._branch = branch or Branch()
        self._stem: list[str] = []
        self._stem_open = True
        self._variables: dict[str, Any] = {}
        self._messages: list[dict[str, str]] = []
        self._role_start: int | None = None

    # -- ProgramState's surface ------------------------------------------------------------------

    def __iadd__(self, other: Node | str) -> TracerState:
        node = as_node(other)
        TRACE_HANDLERS[type(node)](self, node)
        return self

    def __getitem__(self, name: str) -> Any:
        self._close_stem()
        self._step("read", label=name)
        return self._variables.get(name, TracedValue(name))

    def __contains__(self, name: str) -> bool:
        return name in self._variables

    def get(self, name: str, default: Any = None) -> Any:
        return self[name]

    def text(self) -> str:
        return self._text

    def variables(self) -> dict[str, Any]:
        return dict(self._variables)

    def messages(self) -> list[dict[str, str]]:
        return [dict(m) for m in self._messages]

    def get_meta_info(self, name: str) -> Any:
        return None

    def error(self) -> None:
        return None

    def sync(self) -> None:
        pass

    def system(self, value: Node | str | None = None):
        return self._role("system", value)

    def user(self, value: Node | str | None = None):
        return self._role("user", value)

    def assistant(self, value: Node | str | None = None):
        return self._role("assistant", value)

    def _role(self, role: str, value: Node | str | None):
        if value is not None:
            self += RoleBlock(role=role, body=as_node(value))
            return None
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[TracerState]:
        self += RoleBegin(role=role)
        try:
            yield self
        finally:
            self += RoleEnd(role=role)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[TracerState]:
        self += VarScopeBegin(name=name)
        try:
            yield self
        finally:
            self += VarScopeEnd(name=name)

    def fork(self, n: int, *, cache_prefix: bool = True) -> TraceForkGroup:
        self._close_stem()
        step = self._step("fork", label=f"x{n} (prefix sent once, branches submitted together)")
        children = []
        for _ in range(n):
            child = TracerState(template=self._template, text=self._text)
            child._stem_open = False
            child._variables = dict(self._variables)
            step.branches.append(child._branch)
            children.append(child)
        return TraceForkGroup(parent=self, branches=children)

    def text_iter(self, var: str | None = None) -> Iterator[str]:
        yield self._text

    # -- recording -------------------------------------------------------------------------------

    def _step(self, kind: str, *, label: str = "", text: str = "") -> TraceStep:
        steps = self._branch.steps
        if kind == "text" and steps and steps[-1].kind == "text":
            steps[-1].text += text
            self._append(text)
            return steps[-1]
        step = TraceStep(kind=kind, label=label, text=text)
        steps.append(step)
        self._append(text)
        return step

    def _append(self, text: str) -> None:
        if self._stem_open:
            constant, marker, _ = text.partition(_OPEN)
            self._stem.append(constant)
            if marker:
                self._stem_open = False
        self._text += text

    def _close_stem(self) -> None:
        self._stem_open = False

    @property
    def stem(self) -> str:
        return "".join(self._stem)


class TraceForkGroup(Sequence[TracerState]):
    """Branches of a traced fork."""

    def __init__(self, *, parent: TracerState, branches: list[TracerState]):
        self._parent = parent
        self._branches = branches

    def __getitem__(self, index):  # type: ignore[override]
        return self._branches[index]

    def __setitem__(self, index: int, value: TracerState) -> None:
        # ``forks[i] += node`` re-assigns the branch it extended; anything else is a mistake.
        if value is not self._branches[index]:
            raise TypeError("fork branches cannot be replaced")

    def __len__(self) -> int:
        return len(self._branches)

    def join(self, mode: str = "gather_variable") -> None:
        names = {name for b in self._branches for name in b._variables}
        for name in names:
            self._parent._variables[name] = [b._variables.get(name) for b in self._branches]
        self._parent._step("join", label=mode)
        if mode == "concate_and_append":
            self._parent._append(TracedValue("joined branches"))


# -- node handlers ---------------------------------------------------------------------------------------


def _trace_text(st: TracerState, node: Text) -> None:
    st._step("text", text=node.value)


def _trace_seq(st: TracerState, node: Seq) -> None:
    for item in node.items:
        TRACE_HANDLERS[type(item)](st, item)


def _trace_role_block(st: TracerState, node: RoleBlock) -> None:
    for item in (RoleBegin(role=node.role), node.body, RoleEnd(role=node.role)):
        TRACE_HANDLERS[type(item)](st, item)


def _trace_role_begin(st: TracerState, node: RoleBegin) -> None:
    prefix = st._template.markers(node.role, first=not st._messages).prefix
    st._step("role", label=node.role, text=prefix)
    st._role_start = len(st._text)


def _trace_role_end(st: TracerState, node: RoleEnd) -> None:
    content = st._text[st._role_start or 0 :]
    suffix = st._template.markers(node.role, first=not st._messages).suffix
    st._messages.append({"role": node.role, "content": content})
    st._step("end", label=node.role, text=suffix)


def _trace_gen(st: TracerState, node: Gen) -> None:
    st._close_stem()
    options = {**node.params.set_fields()}
    if node.constraint is not None:
        options[node.constraint.kind] = _short(node.constraint.spec)
    if node.output_type is not None:
        options["output"] = getattr(node.output_type, "__name__", str(node.output_type))
    label = " ".join([repr(node.name), *(f"{k}={v!r}" for k, v in options.items())])
    st._step("gen", label=label, text=TracedValue(node.name or "gen"))
    if node.name:
        st._variables[node.name] = TracedValue(node.name)


def _trace_select(st: TracerState, node: Select) -> None:
    st._close_stem()
    label = f"{node.name!r} choices={list(node.choices)!r} method={node.method!r}"
    st._step("select", label=label, text=TracedValue(node.name or "select"))
    if node.name:
        st._variables[node.name] = TracedValue(node.name)


def _trace_scope_begin(st: TracerState, node: VarScopeBegin) -> None:
    st._step("scope", label=repr(node.name))


def _trace_scope_end(st: TracerState, node: VarScopeEnd) -> None:
    st._step("scope end", label=repr(node.name))
    st._variables[node.name] = TracedValue(node.name)


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


TRACE_HANDLERS: dict[type, Callable[[TracerState, Any], None]] = {
    Text: _trace_text,
    Seq: _trace_seq,
    RoleBlock: _trace_role_block,
    RoleBegin: _trace_role_begin,
    RoleEnd: _trace_role_end,
    Gen: _trace_gen,
    Select: _trace_select,
    VarScopeBegin: _trace_scope_begin,
    VarScopeEnd: _trace_scope_end,
}


def trace_program(
    fn: Callable[..., Any],
    arguments: Mapping[str, Any],
    *,
    parameters: Sequence[str],
    template: ChatTemplate,
    name: str,
) -> RequestTree:
    """Trace ``fn(s, **arguments)``; parameters without an argument become placeholders.

    A program that cannot go on without a real value (``int(s["n"])``) is traced up to that point.
    """
    state = TracerState(template=template)
    args = {p: arguments.get(p, TracedValue(p)) for p in parameters}
    args.update({k: v for k, v in arguments.items() if k not in args})
    try:
        fn(state, **args)
    except Exception as exc:
        state._close_stem()
        state._step("stop", label=f"tracing stopped: {type(exc).__name__}: {exc}")
    return RequestTree(name=name, root=state._branch, stem=state.stem)


def shared_stem(trees: Sequence[RequestTree]) -> str:
    """The longest constant text every tree starts with."""
    return os.path.commonprefix([t.stem for t in trees]) if trees else ""
