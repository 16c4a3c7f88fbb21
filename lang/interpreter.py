"""Running programs: :class:`ProgramState` (the ``s`` a program writes to) and its executor.

Each state owns an :class:`Executor` with one worker thread. ``s += node`` only enqueues; the worker
runs nodes in order through a dispatch table keyed by node type. Reading a variable (``s["x"]``),
``s.text()`` or ``fork`` waits for the queue to drain. Because every fork branch has its own worker,
branches run concurrently and their requests reach the server together.

Errors never escape the worker: the first one is recorded, later nodes are skipped, ``s.error()``
returns it and reading a variable it prevented raises :class:`ProgramError`.
"""

from __future__ import annotations

import asyncio
import json
import queue
import random
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from phloem.lang.backends.base import Backend, GenerateRequest, SelectRequest
from phloem.lang.chat_template import ChatTemplate
from phloem.lang.choices import resolve_method
from phloem.lang.ir import (
    Gen,
    Node,
    RoleBegin,
    RoleBlock,
    RoleEnd,
    SamplingParams,
    Select,
    Seq,
    Text,
    VarScopeBegin,
    VarScopeEnd,
    as_node,
)


class ProgramError(RuntimeError):
    """A program could not produce what was read from it (the cause is chained)."""


_STOP = object()


class Executor:
    """Owns one program's (or fork branch's) text, variables and messages, and the worker that
    fills them. All fields are guarded by ``_cond``; readers wait on it for progress."""

    def __init__(
        self,
        *,
        backend: Backend,
        defaults: SamplingParams,
        stream: bool = False,
        rng: random.Random | None = None,
    ):
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.rng = rng or random.Random()
        self.text = ""
        self.variables: dict[str, Any] = {}
        self.meta: dict[str, Any] = {}
        self.messages: list[dict[str, str]] = []
        self.open_role: tuple[str, int] | None = None  # (role, index where its content starts)
        self.scopes: dict[str, int] = {}
        self.partial: dict[str, str] = {}  # text of variables being generated, for streaming
        self.finished_vars: set[str] = set()
        self.error: BaseException | None = None
        self.children: list[Executor] = []
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = 0
        self._closed = False
        self.done = False
        self.body_thread: int | None = None  # set while a streaming program body runs on a thread
        threading.Thread(target=self._loop, name="phloem-executor", daemon=True).start()

    # -- queue ---------------------------------------------------------------------------------

    def submit(self, node: Node) -> None:
        with self._cond:
            if self._closed:
                raise ProgramError("the program has finished; it takes no more nodes")
            self._pending += 1
        self._queue.put(node)

    def _loop(self) -> None:
        while (node := self._queue.get()) is not _STOP:
            try:
                if self.error is None:
                    self.dispatch(node)
            except Exception as exc:
                self.record_error(exc)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()
        with self._cond:
            self.done = True
            self._cond.notify_all()

    def dispatch(self, node: Node) -> None:
        handler = HANDLERS.get(type(node))
        if handler is None:
            raise TypeError(f"no handler for IR node {type(node).__name__}")
        handler(self, node)

    def sync(self) -> None:
        """Wait until every submitted node has run (outside a streaming body: until it finished)."""
        with self._cond:
            self._cond.wait_for(self._settled)

    def _settled(self) -> bool:
        outside_body = self.body_thread is not None and threading.get_ident() != self.body_thread
        return self._pending == 0 and (self.done or not outside_body)

    def finish(self) -> None:
        """Run what is queued, stop the worker (and unjoined branches' workers), wait for it."""
        for child in self.children:
            child.finish()
        with self._cond:
            if self._closed:
                self._cond.wait_for(lambda: self.done)
                return
            self._closed = True
        self._queue.put(_STOP)
        with self._cond:
            self._cond.wait_for(lambda: self.done)

    def record_error(self, exc: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = exc
            self._cond.notify_all()

    # -- state updates (worker side) -------------------------------------------------------------

    @property
    def template(self) -> ChatTemplate:
        return self.backend.chat_template()

    def append(self, text: str, *, var: str | None = None) -> None:
        with self._cond:
            self.text += text
            if var is not None:
                self.partial[var] = self.partial.get(var, "") + text
            for name, start in self.scopes.items():
                self.partial[name] = self.text[start:]
            self._cond.notify_all()

    def begin_var(self, name: str | None) -> None:
        if name is None:
            return
        with self._cond:
            self.partial[name] = ""
            self.finished_vars.discard(name)

    def set_var(self, name: str | None, value: Any, meta: Any = None) -> None:
        if name is None:
            return
        with self._cond:
            self.variables[name] = value
            if meta is not None:
                self.meta[name] = meta
            self.finished_vars.add(name)
            self._cond.notify_all()

    def generate_request(self, node: Gen) -> GenerateRequest:
        role, start = self.open_role or (None, len(self.text))
        return GenerateRequest(
            text=self.text,
            params=node.params.merged_over(self.defaults),
            constraint=node.constraint,
            logprobs=node.logprobs,
            messages=tuple(dict(m) for m in self.messages),
            open_role=role,
            open_role_text=self.text[start:],
        )

    # -- reads (program side) --------------------------------------------------------------------

    def get_var(self, name: str) -> Any:
        with self._cond:
            self._cond.wait_for(lambda: name in self.variables or self._settled())
            if name in self.variables:
                return self.variables[name]
            if self.error is not None:
                raise ProgramError(f"variable {name!r} is unavailable: {self.error!r}") from self.error
        raise KeyError(f"program has no variable {name!r}")

    def next_chunk(self, var: str | None, pos: int) -> str | None:
        """Block until text past ``pos`` exists (return it) or the stream has ended (return None)."""

        def current() -> str:
            return self.text if var is None else self.partial.get(var, "")

        def ended() -> bool:
            return self.done or (var is not None and var in self.finished_vars)

        with self._cond:
            self._cond.wait_for(lambda: len(current()) > pos or ended())
            text = current()
        return text[pos:] if len(text) > pos else None

    # -- fork / join -----------------------------------------------------------------------------

    def spawn(self) -> Executor:
        """A branch starting from this executor's current state (call after :meth:`sync`)."""
        child = Executor(
            backend=self.backend,
            defaults=self.defaults,
            stream=self.stream,
            rng=random.Random(self.rng.random()),
        )
        with self._cond:
            child.text = self.text
            child.variables = dict(self.variables)
            child.meta = dict(self.meta)
            child.messages = [dict(m) for m in self.messages]
            child.open_role = self.open_role
            child.scopes = dict(self.scopes)
            child.error = self.error
            self.children.append(child)
        return child

    def absorb(self, children: Sequence[Executor], *, mode: str, fork_pos: int, before: Mapping[str, Any]):
        """Join: gather branch variables into lists; with ``concate_and_append`` also append their text."""
        for child in children:
            child.finish()
        self.sync()
        names = _new_variables(children, before)
        with self._cond:
            for name in names:
                self.variables[name] = [c.variables.get(name) for c in children]
                self.meta[name] = [c.meta.get(name) for c in children]
                self.finished_vars.add(name)
            if mode == "concate_and_append":
                self.text += "".join(c.text[fork_pos:] for c in children)
                for child in children:
                    self.messages.extend(child.messages[len(self.messages) :])
            self.error = self.error or next((c.error for c in children if c.error), None)
            self._cond.notify_all()


def _new_variables(children: Sequence[Executor], before: Mapping[str, Any]) -> list[str]:
    names: dict[str, None] = {}
    for child in children:
        for name, value in child.variables.items():
            if name not in before or value is not before[name]:
                names[name] = None
    return list(names)


# -- node handlers ----------------------------------------------------------------------------------


def _run_text(ex: Executor, node: Text) -> None:
    ex.append(node.value)


def _run_seq(ex: Executor, node: Seq) -> None:
    for item in node.items:
        ex.dispatch(item)


def _run_role_block(ex: Executor, node: RoleBlock) -> None:
    ex.dispatch(RoleBegin(role=node.role))
    ex.dispatch(node.body)
    ex.dispatch(RoleEnd(role=node.role))


def _run_role_begin(ex: Executor, node: RoleBegin) -> None:
    if ex.open_role is not None:
        raise ProgramError(f"cannot open role {node.role!r} inside role {ex.open_role[0]!r}")
    ex.append(ex.template.markers(node.role, first=not ex.messages).prefix)
    ex.open_role = (node.role, len(ex.text))


def _run_role_end(ex: Executor, node: RoleEnd) -> None:
    if ex.open_role is None or ex.open_role[0] != node.role:
        open_name = ex.open_role[0] if ex.open_role else None
        raise ProgramError(f"role end {node.role!r} does not match the open role {open_name!r}")
    content = ex.text[ex.open_role[1] :]
    ex.open_role = None
    first = not ex.messages
    ex.append(ex.template.markers(node.role, first=first).suffix)
    with ex._cond:
        ex.messages.append({"role": node.role, "content": content})


def _run_gen(ex: Executor, node: Gen) -> None:
    request = ex.generate_request(node)
    ex.begin_var(node.name)
    if ex.stream and (request.params.n or 1) == 1:
        texts, metas = _stream_gen(ex, request, node.name)
    else:
        out = ex.backend.generate(request)
        ex.append(out.text, var=node.name)
        texts, metas = out.texts, out.meta_infos
    values = [decode_output(t, node.output_type) for t in texts]
    if len(values) == 1:
        ex.set_var(node.name, values[0], metas[0])
    else:
        ex.set_var(node.name, values, list(metas))


def _stream_gen(ex: Executor, request: GenerateRequest, name: str | None) -> tuple[list[str], list[dict]]:
    text = ""
    meta: dict[str, Any] = {}
    for chunk in ex.backend.generate_stream(request):
        if chunk.delta:
            ex.append(chunk.delta, var=name)
            text += chunk.delta
        meta = chunk.meta_info if chunk.meta_info is not None else meta
    return [text], [meta]


def _run_select(ex: Executor, node: Select) -> None:
    method = resolve_method(node.method)
    request = SelectRequest(prefix=ex.text, choices=node.choices, unconditional=method.needs_unconditional)
    logprobs = ex.backend.choice_logprobs(request)
    decision = method.decide(logprobs, temperature=node.temperature, rng=ex.rng)
    choice = node.choices[decision.index]
    ex.begin_var(node.name)
    ex.append(choice, var=node.name)
    meta = {
        "method": decision.method,
        "index": decision.index,
        "scores": list(decision.scores),
        "choices": list(node.choices),
        "conditional_logprobs": [list(c) for c in logprobs.conditional],
        "unconditional_logprobs": None
        if logprobs.unconditional is None
        else [list(u) for u in logprobs.unconditional],
    }
    ex.set_var(node.name, choice, meta)


def _run_scope_begin(ex: Executor, node: VarScopeBegin) -> None:
    ex.scopes[node.name] = len(ex.text)
    ex.begin_var(node.name)


def _run_scope_end(ex: Executor, node: VarScopeEnd) -> None:
    start = ex.scopes.pop(node.name, None)
    if start is None:
        raise ProgramError(f"var_scope {node.name!r} ended without a begin")
    ex.set_var(node.name, ex.text[start:])


HANDLERS: dict[type, Callable[[Executor, Any], None]] = {
    Text: _run_text,
    Seq: _run_seq,
    RoleBlock: _run_role_block,
    RoleBegin: _run_role_begin,
    RoleEnd: _run_role_end,
    Gen: _run_gen,
    Select: _run_select,
    VarScopeBegin: _run_scope_begin,
    VarScopeEnd: _run_scope_end,
}
"""Node type -> handler. A new node type needs exactly one entry here."""


# -- outputs ------------------------------------------------------------------------------------------


def decode_output(text: str, output_type: Any) -> Any:
    """Convert generated text to the type a ``gen`` asked for."""
    try:
        return _DECODERS.get(output_type, _decode_model)(text, output_type)
    except Exception as exc:
        raise ProgramError(
            f"cannot read {text!r} as {getattr(output_type, '__name__', output_type)}"
        ) from exc


def _decode_str(text: str, _: Any) -> str:
    value = json.loads(text)
    if not isinstance(value, str):
        raise ValueError("not a JSON string")
    return value


def _decode_model(text: str, model: Any) -> Any:
    return model.model_validate_json(text)


_DECODERS: dict[Any, Callable[[str, Any], Any]] = {
    None: lambda text, _: text,
    int: lambda text, _: int(text.strip()),
    float: lambda text, _: float(text.strip()),
    bool: lambda text, _: {"True": True, "False": False, "true": True, "false": False}[text.strip()],
    str: _decode_str,
}


# -- the user-facing state ----------------------------------------------------------------------------


class ProgramState:
    """What a program writes to (``s += ...``) and what ``run`` returns.

    Thread-safe; reads wait for the nodes submitted before them.
    """

    def __init__(self, executor: Executor):
        self._ex = executor

    def __iadd__(self, other: Node | str) -> ProgramState:
        self._ex.submit(as_node(other))
        return self

    def __getitem__(self, name: str) -> Any:
        return self._ex.get_var(name)

    def __contains__(self, name: str) -> bool:
        self._ex.sync()
        return name in self._ex.variables

    def __repr__(self) -> str:
        return f"ProgramState(text={self._ex.text[-60:]!r}, variables={sorted(self._ex.variables)})"

    def get(self, name: str, default: Any = None) -> Any:
        """A variable, or ``default`` when the program never set it."""
        try:
            return self[name]
        except (KeyError, ProgramError):
            return default

    def text(self) -> str:
        """The full program text so far."""
        self._ex.sync()
        return self._ex.text

    def variables(self) -> dict[str, Any]:
        """A copy of every variable."""
        self._ex.sync()
        return dict(self._ex.variables)

    def messages(self) -> list[dict[str, str]]:
        """Finished chat turns as ``{"role", "content"}`` dicts."""
        self._ex.sync()
        return [dict(m) for m in self._ex.messages]

    def get_meta_info(self, name: str) -> Any:
        """Meta info of the ``gen`` or ``select`` that set ``name`` (select: its scores)."""
        self._ex.get_var(name)
        return self._ex.meta.get(name)

    def error(self) -> BaseException | None:
        """The first error the program hit, or ``None``."""
        self._ex.sync()
        return self._ex.error

    def sync(self) -> None:
        """Wait for everything submitted so far."""
        self._ex.sync()

    # -- roles ---------------------------------------------------------------------------------

    def system(self, value: Node | str | None = None):
        """``s.system("...")`` appends a turn; ``with s.system():`` wraps the nodes added inside."""
        return self._role("system", value)

    def user(self, value: Node | str | None = None):
        """``s.user("...")`` appends a turn; ``with s.user():`` wraps the nodes added inside."""
        return self._role("user", value)

    def assistant(self, value: Node | str | None = None):
        """``s.assistant(gen(...))`` appends a turn; ``with s.assistant():`` wraps nodes added inside."""
        return self._role("assistant", value)

    def _role(self, role: str, value: Node | str | None):
        if value is not None:
            self._ex.submit(RoleBlock(role=role, body=as_node(value)))
            return None
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[ProgramState]:
        self._ex.submit(RoleBegin(role=role))
        try:
            yield self
        finally:
            self._ex.submit(RoleEnd(role=role))

    @contextmanager
    def var_scope(self, name: str) -> Iterator[ProgramState]:
        """Capture the text appended inside the ``with`` block into the variable ``name``."""
        self._ex.submit(VarScopeBegin(name=name))
        try:
            yield self
        finally:
            self._ex.submit(VarScopeEnd(name=name))

    # -- fork ----------------------------------------------------------------------------------

    def fork(self, n: int, *, cache_prefix: bool = True) -> ForkGroup:
        """Branch into ``n`` states that continue from the current text.

        Waits for the text so far; with ``n > 1`` sends it once as a prefill so the branches share its
        KV; each branch then runs on its own worker, so their requests arrive together.
        """
        if n < 1:
            raise ValueError("fork needs n >= 1")
        self._ex.sync()
        if cache_prefix and n > 1 and self._ex.text and self._ex.error is None:
            try:
                self._ex.backend.cache_prefix(self._ex.text)
            except Exception as exc:
                self._ex.record_error(exc)
        before = dict(self._ex.variables)
        children = [ProgramState(self._ex.spawn()) for _ in range(n)]
        return ForkGroup(parent=self, branches=children, fork_pos=len(self._ex.text), before=before)

    # -- streaming -----------------------------------------------------------------------------

    def text_iter(self, var: str | None = None) -> Iterator[str]:
        """Yield new text as it is produced: the whole program's, or one variable's."""
        pos = 0
        while (chunk := self._ex.next_chunk(var, pos)) is not None:
            pos += len(chunk)
            yield chunk

    async def text_async_iter(self, var: str | None = None) -> AsyncIterator[str]:
        """:meth:`text_iter` for asyncio; waiting happens on a worker thread."""
        pos = 0
        while (chunk := await asyncio.to_thread(self._ex.next_chunk, var, pos)) is not None:
            pos += len(chunk)
            yield chunk


_JOIN_MODES = ("gather_variable", "concate_and_append")


class ForkGroup(Sequence[ProgramState]):
    """The branches of a fork; index or iterate them, then :meth:`join`."""

    def __init__(
        self, *, parent: ProgramState, branches: list[ProgramState], fork_pos: int, before: dict[str, Any]
    ):
        self._parent = parent
        self._branches = branches
        self._fork_pos = fork_pos
        self._before = before

    def __getitem__(self, index):  # type: ignore[override]
        return self._branches[index]

    def __setitem__(self, index: int, value: ProgramState) -> None:
        # ``forks[i] += node`` re-assigns the branch it extended; anything else is a mistake.
        if value is not self._branches[index]:
            raise TypeError("fork branches cannot be replaced")

    def __len__(self) -> int:
        return len(self._branches)

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch; each variable a branch set becomes a list (one entry per branch) on
        the parent. ``concate_and_append`` also appends each branch's new text to the parent's."""
        if mode not in _JOIN_MODES:
            raise ValueError(f"join mode must be one of {_JOIN_MODES}, not {mode!r}")
        self._parent._ex.absorb(
            [b._ex for b in self._branches], mode=mode, fork_pos=self._fork_pos, before=self._before
        )


# -- running a program --------------------------------------------------------------------------------


def run_program(
    fn: Callable[..., Any],
    arguments: Mapping[str, Any],
    *,
    backend: Backend,
    defaults: SamplingParams,
    stream: bool = False,
) -> ProgramState:
    """Run ``fn(s, **arguments)``. Without ``stream`` returns when the program has finished; with it
    returns at once while the program runs on a thread (read it with ``text_iter``)."""
    state = ProgramState(Executor(backend=backend, defaults=defaults, stream=stream))
    if stream:
        body = threading.Thread(target=_run_body, args=(fn, state, arguments), daemon=True)
        body.start()
        state._ex.body_thread = body.ident
    else:
        _run_body(fn, state, arguments)
    return state


def _run_body(fn: Callable[..., Any], state: ProgramState, arguments: Mapping[str, Any]) -> None:
    failure: Exception | None = None
    try:
        fn(state, **arguments)
    except Exception as exc:
        failure = exc
    if failure is not None:
        state._ex.sync()  # what the body queued before failing still runs
        state._ex.record_error(failure)
    state._ex.finish()
