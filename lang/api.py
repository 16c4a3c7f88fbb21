"""The DSL's verbs: ``function``, ``gen`` and friends, ``select``, roles, and the default backend."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from typing import Any

from phloem.lang.backends.base import Backend
from phloem.lang.chat_template import ChatTemplate
from phloem.lang.choices import ChoicesMethod, resolve_method, token_length_normalized
from phloem.lang.interpreter import ProgramState, run_program
from phloem.lang.ir import (
    Constraint,
    Gen,
    LogprobOptions,
    Node,
    RoleBegin,
    RoleBlock,
    RoleEnd,
    SamplingParams,
    Select,
    as_node,
)
from phloem.lang.prefix_check import (
    late_stems,
    prompt_text,
    shared_prefix_ratio,
    varying_arguments,
    warning_text,
)
from phloem.lang.tracer import RequestTree, TracedValue, shared_stem, trace_program

logger = logging.getLogger("phloem.lang")

# -- default backend ---------------------------------------------------------------------------------------

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """Backend used by ``run``/``run_batch``/``trace`` when none is passed."""
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    """The backend set by :func:`set_default_backend`, or ``None``."""
    return _default_backend


def _backend_or_default(backend: Backend | None) -> Backend:
    chosen = backend or _default_backend
    if chosen is None:
        raise RuntimeError("no backend: pass backend=... or call phloem.set_default_backend(...) first")
    return chosen


# -- program-wide sampling defaults ------------------------------------------------------------------------

_DEFAULT_ALIASES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
_DEFAULT_NAMES = {f.name for f in fields(SamplingParams)} | set(_DEFAULT_ALIASES)


def sampling_defaults(options: dict[str, Any]) -> SamplingParams:
    """Program-wide defaults from ``run``'s keyword arguments (``max_new_tokens`` or ``max_tokens``)."""
    values = {_DEFAULT_ALIASES.get(k, k): v for k, v in options.items() if v is not None}
    for key in ("stop", "stop_token_ids", "stop_regex"):
        if key in values:
            values[key] = _as_tuple(values[key])
    return SamplingParams(**values)


def _as_tuple(value: str | Sequence[Any] | None) -> tuple[Any, ...] | None:
    if value is None:
        return None
    return (value,) if isinstance(value, str | int) else tuple(value)


# -- function ---------------------------------------------------------------------------------------------


class Program:
    """A decorated program: ``run``, ``run_batch``, ``arun`` and ``trace`` it.

    Keyword arguments that name one of the function's parameters are program arguments; the others
    are options (``backend``, ``stream``) or program-wide sampling defaults (``temperature``,
    ``max_new_tokens``, ``top_p``, ``stop``, ...).
    """

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.name = getattr(fn, "__name__", "program")
        params = list(inspect.signature(fn).parameters.values())[1:]
        self._params = {p.name: p for p in params}
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn
        # prompt order checks (prefix_check): the previous call's arguments, and the arguments
        # already checked (each is traced once, so repeated calls cost nothing more)
        self._lock = threading.Lock()
        self._last_arguments: dict[str, Any] | None = None
        self._checked: set[str] = set()

    def __repr__(self) -> str:
        return f"<phloem program {self.name}({', '.join(self._params)})>"

    def __call__(
        self, *, backend: Backend | None = None, stream: bool = False, **kwargs: Any
    ) -> ProgramState:
        return self.run(backend=backend, stream=stream, **kwargs)

    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], SamplingParams]:
        arguments = {k: v for k, v in kwargs.items() if k in self._params}
        options = {k: v for k, v in kwargs.items() if k not in self._params}
        unknown = sorted(set(options) - _DEFAULT_NAMES)
        if unknown:
            raise TypeError(f"{self.name}() got unexpected arguments {unknown}")
        return arguments, sampling_defaults(options)

    def run(self, *, backend: Backend | None = None, stream: bool = False, **kwargs: Any) -> ProgramState:
        """Run once. Returns the finished state, or (``stream=True``) a state still being written.

        Logs a warning (once per argument) when an argument that changed since the previous call is
        written ahead of a long constant text (see :mod:`phloem.lang.prefix_check`)."""
        chosen = _backend_or_default(backend)
        arguments, _ = self._split(kwargs)
        with self._lock:
            previous, self._last_arguments = self._last_arguments, arguments
        if previous is not None:
            self._check_order([previous, arguments], chosen)
        return self._run(chosen, stream, kwargs)

    def _run(self, backend: Backend, stream: bool, kwargs: dict[str, Any]) -> ProgramState:
        arguments, defaults = self._split(kwargs)
        return run_program(self.fn, arguments, backend=backend, defaults=defaults, stream=stream)

    async def arun(
        self, *, backend: Backend | None = None, stream: bool = False, **kwargs: Any
    ) -> ProgramState:
        """:meth:`run` without blocking the event loop."""
        return await asyncio.to_thread(self.run, backend=backend, stream=stream, **kwargs)

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any]],
        *,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        backend: Backend | None = None,
        **options: Any,
    ) -> BatchStates:
        """Run once per argument dict, concurrently; states come back in input order, in a list
        whose ``shared_prefix_ratio`` says how much of the calls' prompts they share (also logged).

        The constant stem the programs share is sent once (a prefill-only request) before the batch.
        An argument whose value differs between calls and that is written ahead of a long constant
        text is named in a warning: moving it after that text lets the calls share it.
        """
        chosen = _backend_or_default(backend)
        ratio = 0.0
        if len(batch_kwargs) > 1:
            self._check_order([self._split(kw)[0] for kw in batch_kwargs], chosen)
            ratio = self._cache_stem(batch_kwargs, chosen)
            logger.info(
                "program %s: %d calls share %.0f%% of their prompt text",
                self.name,
                len(batch_kwargs),
                100 * ratio,
            )
        workers = _thread_count(num_threads, len(batch_kwargs))

        def one(kwargs: dict[str, Any]) -> ProgramState:
            return self._run(chosen, False, {**kwargs, **options})

        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = pool.map(one, batch_kwargs)
            return BatchStates(_with_progress(results, len(batch_kwargs), enabled=progress_bar), ratio)

    def _cache_stem(self, batch_kwargs: Sequence[dict[str, Any]], backend: Backend) -> float:
        """Send the batch's shared stem; returns the batch's shared-prefix ratio."""
        template = _template_or_default(backend)
        trees = [self._trace(self._split(kw)[0], template) for kw in batch_kwargs]
        stem = shared_stem(trees)
        if stem:
            backend.cache_prefix(stem)
        return shared_prefix_ratio([prompt_text(t) for t in trees])

    def _check_order(self, calls: Sequence[dict[str, Any]], backend: Backend) -> None:
        """Warn about changing arguments written ahead of a long constant text (once each)."""
        with self._lock:
            varying = [name for name in varying_arguments(calls) if name not in self._checked]
            self._checked.update(varying)
        if not varying:
            return
        traced = {k: v for k, v in calls[-1].items() if k not in varying}
        traced.update({name: TracedValue(name) for name in varying})
        tree = self._trace(traced, _template_or_default(backend))
        for late in late_stems(prompt_text(tree), varying):
            logger.warning(warning_text(self.name, late))

    def trace(self, *, backend: Backend | None = None, **kwargs: Any) -> RequestTree:
        """The request tree of this program for these arguments (missing ones become placeholders).

        Sends nothing; the backend (or the default one) only supplies the chat template.
        """
        arguments, _ = self._split(kwargs)
        return self._trace(arguments, _template_or_default(backend or _default_backend))

    def _trace(self, arguments: dict[str, Any], template: ChatTemplate) -> RequestTree:
        required = [n for n, p in self._params.items() if p.default is inspect.Parameter.empty]
        return trace_program(self.fn, arguments, parameters=required, template=template, name=self.name)


class BatchStates(list):  # type: ignore[type-arg]  # a list of ProgramState
    """What :meth:`Program.run_batch` returns: the states in input order, plus
    ``shared_prefix_ratio``: the share of the calls' prompt text (before each one's first
    generation) that a prefix cache could serve from another call of the batch (0.0 to 1.0)."""

    def __init__(self, states: Any = (), shared_prefix_ratio: float = 0.0) -> None:
        super().__init__(states)
        self.shared_prefix_ratio = shared_prefix_ratio


def function(fn: Callable[..., Any]) -> Program:
    """Decorate ``def program(s, ...)`` to make a runnable :class:`Program`."""
    return Program(fn)


def _template_or_default(backend: Backend | None) -> ChatTemplate:
    if backend is not None:
        try:
            return backend.chat_template()
        except Exception:  # a trace must not need a reachable server
            pass
    return ChatTemplate.registered()


def _thread_count(num_threads: int | str, batch_size: int) -> int:
    if num_threads == "auto":
        return max(1, min(batch_size, 4 * (os.cpu_count() or 1), 64))
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be 'auto' or a positive int, not {num_threads!r}")
    return num_threads


def _with_progress(results: Any, total: int, *, enabled: bool) -> Any:
    if not enabled:
        return results
    try:
        from tqdm import tqdm
    except ImportError:
        return results
    return tqdm(results, total=total)


# -- gen ----------------------------------------------------------------------------------------------------

_DTYPE_REGEX: dict[type, str] = {
    int: r"-?(0|[1-9][0-9]*)",
    float: r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    bool: r"(True|False)",
    str: r'"([^"\\\n]|\\.)*"',
}


def gen(
    name: str | None = None,
    *,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    stop_regex: str | Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool = False,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | type | None = None,
    ebnf: str | None = None,
    dtype: type | None = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesMethod | str = token_length_normalized,
    n: int | None = None,
) -> Node:
    """Generate text and store it under ``name``.

    Parameters
    ----------
    name:
        Variable to store the output in (``s[name]``); ``None`` keeps only the text.
    max_tokens, min_tokens, stop, stop_token_ids, stop_regex, temperature, top_p, top_k, min_p,
    frequency_penalty, presence_penalty, ignore_eos, n:
        Sampling; unset ones inherit the program-wide defaults given to ``run``.
    return_logprob, logprob_start_len, top_logprobs_num:
        Log probabilities to return in ``s.get_meta_info(name)``.
    regex, json_schema, ebnf, dtype:
        At most one constraint. ``json_schema`` may be a JSON string, a dict or a pydantic model
        class (the parsed model instance is stored). ``dtype`` is ``int``, ``float``, ``bool`` or
        ``str`` (a quoted string); the converted value is stored.
    choices, choices_method:
        Turn this into :func:`select` (``temperature`` defaults to 0).
    """
    if choices is not None:
        return select(name, choices=choices, temperature=temperature or 0.0, choices_method=choices_method)
    constraint, output_type = _constraint(regex=regex, json_schema=json_schema, ebnf=ebnf, dtype=dtype)
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=_as_tuple(stop),
        stop_token_ids=_as_tuple(stop_token_ids),
        stop_regex=_as_tuple(stop_regex),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        n=n,
    )
    logprobs = LogprobOptions(
        return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num
    )
    return Gen(name=name, params=params, constraint=constraint, logprobs=logprobs, output_type=output_type)


def _constraint(
    *, regex: str | None, json_schema: Any, ebnf: str | None, dtype: type | None
) -> tuple[Constraint | None, Any]:
    given = [
        k
        for k, v in (("regex", regex), ("json_schema", json_schema), ("ebnf", ebnf), ("dtype", dtype))
        if v is not None
    ]
    if len(given) > 1:
        raise ValueError(f"gen() takes at most one of regex, json_schema, ebnf, dtype; got {given}")
    if regex is not None:
        return Constraint(kind="regex", spec=regex), None
    if ebnf is not None:
        return Constraint(kind="ebnf", spec=ebnf), None
    if dtype is not None:
        if dtype not in _DTYPE_REGEX:
            raise ValueError(f"dtype must be one of int, float, bool, str; got {dtype!r}")
        return Constraint(kind="regex", spec=_DTYPE_REGEX[dtype]), dtype
    if json_schema is not None:
        return _json_constraint(json_schema)
    return None, None


def _json_constraint(schema: Any) -> tuple[Constraint, Any]:
    if isinstance(schema, str):
        return Constraint(kind="json_schema", spec=schema), None
    if isinstance(schema, dict):
        return Constraint(kind="json_schema", spec=json.dumps(schema)), None
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return Constraint(kind="json_schema", spec=json.dumps(schema.model_json_schema())), schema
    raise TypeError(f"json_schema must be a JSON string, a dict or a pydantic model class, not {schema!r}")


def gen_int(name: str | None = None, **options: Any) -> Node:
    """``gen(name, dtype=int, ...)``: an integer, stored as ``int``."""
    return gen(name, dtype=int, **options)


def gen_string(name: str | None = None, **options: Any) -> Node:
    """``gen(name, dtype=str, ...)``: a double-quoted string; the unquoted value is stored."""
    return gen(name, dtype=str, **options)


def gen_json(name: str | None, schema: Any, **options: Any) -> Node:
    """``gen(name, json_schema=schema, ...)``; with a pydantic model the parsed instance is stored."""
    return gen(name, json_schema=schema, **options)


# -- select -------------------------------------------------------------------------------------------------


def select(
    name: str | None = None,
    *,
    choices: Sequence[str],
    temperature: float = 0.0,
    choices_method: ChoicesMethod | str = token_length_normalized,
) -> Node:
    """Append the choice the model scores best and store it under ``name``.

    All choices are scored in one batched prefill request from input-token log probabilities.
    ``temperature > 0`` samples from ``softmax(scores / temperature)``. The scores are in
    ``s.get_meta_info(name)["scores"]``.
    """
    options = tuple(choices)
    if not options or not all(isinstance(c, str) for c in options):
        raise ValueError("select() needs a non-empty list of strings as choices")
    if temperature < 0:
        raise ValueError("select() temperature must be >= 0")
    return Select(name=name, choices=options, temperature=temperature, method=resolve_method(choices_method))


# -- roles --------------------------------------------------------------------------------------------------


def _role_block(role: str, body: Node | str) -> Node:
    return RoleBlock(role=role, body=as_node(body))


def system(body: Node | str = "") -> Node:
    """A system turn: ``s += system("You are terse.")``."""
    return _role_block("system", body)


def user(body: Node | str = "") -> Node:
    """A user turn: ``s += user("Hi")``."""
    return _role_block("user", body)


def assistant(body: Node | str = "") -> Node:
    """An assistant turn: ``s += assistant(gen("reply"))``."""
    return _role_block("assistant", body)


def system_begin() -> Node:
    """Open a system turn (close it with :func:`system_end`)."""
    return RoleBegin(role="system")


def system_end() -> Node:
    """Close the open system turn."""
    return RoleEnd(role="system")


def user_begin() -> Node:
    """Open a user turn (close it with :func:`user_end`)."""
    return RoleBegin(role="user")


def user_end() -> Node:
    """Close the open user turn."""
    return RoleEnd(role="user")


def assistant_begin() -> Node:
    """Open an assistant turn (close it with :func:`assistant_end`)."""
    return RoleBegin(role="assistant")


def assistant_end() -> Node:
    """Close the open assistant turn."""
    return RoleEnd(role="assistant")
