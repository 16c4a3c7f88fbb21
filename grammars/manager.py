"""Compile cache and thread pool: requests wait on futures while their grammar compiles.

``GrammarManager.submit`` never raises for bad input and never blocks: every outcome (compiled,
invalid, timed out) arrives through the returned future, so one hostile grammar fails only its own
request. Failures are cached like successes, so repeating a hostile spec costs a dictionary lookup.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from .base import CompiledGrammar, GrammarBackend, GrammarError, GrammarKind, GrammarMatcher, GrammarSpec

MAX_SPEC_BYTES = 1 << 20
MAX_NESTING_DEPTH = 128
MAX_REGEX_ALTERNATIVES = 2048
MAX_EXPANDED_SIZE = 100_000  # atoms after unrolling counted repetitions such as (a{1000}){1000}
_SIZE_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")


@dataclass(frozen=True)
class GrammarStats:
    """Counters for metrics; a snapshot (later compiles do not change it)."""

    hits: int
    misses: int
    failures: int
    timeouts: int
    compile_seconds: float


class GrammarManager:
    """Per-model compile cache in front of a :class:`GrammarBackend`.

    Parameters
    ----------
    backend : GrammarBackend
        The model's backend.
    max_workers : int
        Compile threads.
    compile_timeout : float
        Seconds after submission at which a compile still running is reported as failed (the
        thread itself runs on; its late result is discarded).
    max_entries : int
        Cache size; least recently used entries are dropped first.
    on_compiled : Callable[[float], None] | None
        Called with the duration of each finished compile (e.g. a metrics histogram).
    """

    def __init__(
        self,
        backend: GrammarBackend,
        *,
        max_workers: int = 2,
        compile_timeout: float = 30.0,
        max_entries: int = 1024,
        on_compiled: Callable[[float], None] | None = None,
    ) -> None:
        self.backend = backend
        self.compile_timeout = compile_timeout
        self._max_entries = max_entries
        self._on_compiled = on_compiled
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[GrammarSpec, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = self._failures = self._timeouts = 0
        self._compile_seconds = 0.0

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """The future compiled grammar of ``spec`` (cached, or compiling in the pool).

        The future fails with :class:`GrammarError` for invalid specs and timeouts.
        """
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._hits += 1
                self._cache.move_to_end(spec)
                return cached
            self._misses += 1
            future: Future[CompiledGrammar] = Future()
            self._remember(spec, future)
        self._start(spec, future)
        return future

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Blocking form of :meth:`submit`; raises :class:`GrammarError`."""
        return self.submit(spec).result()

    def new_matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh per-request matcher."""
        return self.backend.new_matcher(compiled)

    def stats(self) -> GrammarStats:
        """Current counters."""
        with self._lock:
            return GrammarStats(
                self._hits, self._misses, self._failures, self._timeouts, self._compile_seconds
            )

    def clear(self) -> None:
        """Forget every cached grammar (running compiles still finish into their futures)."""
        with self._lock:
            self._cache.clear()

    def shutdown(self) -> None:
        """Stop accepting work; does not wait for running compiles."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _remember(self, spec: GrammarSpec, future: Future[CompiledGrammar]) -> None:
        self._cache[spec] = future
        while len(self._cache) > self._max_entries:
            self._cache.popitem(last=False)

    def _start(self, spec: GrammarSpec, future: Future[CompiledGrammar]) -> None:
        try:
            validate_spec(spec)
        except GrammarError as exc:
            self._fail(future, exc)
            return
        timer = threading.Timer(self.compile_timeout, self._time_out, args=(spec, future))
        timer.daemon = True
        timer.start()
        self._pool.submit(self._run, spec, future, timer)

    def _run(self, spec: GrammarSpec, future: Future[CompiledGrammar], timer: threading.Timer) -> None:
        start = time.perf_counter()
        try:
            compiled = self.backend.compile(spec)
        except Exception as exc:  # GrammarError, or a backend bug: fail this request only
            error = exc if isinstance(exc, GrammarError) else GrammarError(f"grammar compile failed: {exc}")
            self._finish(future, timer, error=error)
        else:
            self._finish(future, timer, result=compiled)
        self._record_time(time.perf_counter() - start)

    def _finish(
        self,
        future: Future[CompiledGrammar],
        timer: threading.Timer,
        *,
        result: CompiledGrammar | None = None,
        error: GrammarError | None = None,
    ) -> None:
        timer.cancel()
        with self._lock:
            if future.done():  # already timed out
                return
            if error is None:
                future.set_result(result)  # type: ignore[arg-type]
                return
            self._failures += 1
            future.set_exception(error)

    def _time_out(self, spec: GrammarSpec, future: Future[CompiledGrammar]) -> None:
        with self._lock:
            if future.done():
                return
            self._timeouts += 1
            self._failures += 1
            future.set_exception(
                GrammarError(f"{spec.kind.value} grammar did not compile within {self.compile_timeout:g} s")
            )

    def _fail(self, future: Future[CompiledGrammar], error: GrammarError) -> None:
        with self._lock:
            self._failures += 1
            future.set_exception(error)

    def _record_time(self, seconds: float) -> None:
        with self._lock:
            self._compile_seconds += seconds
        if self._on_compiled is not None:
            self._on_compiled(seconds)


def poll(future: Future[CompiledGrammar]) -> CompiledGrammar | None:
    """The compiled grammar if ready, None while compiling; raises :class:`GrammarError` on failure."""
    if not future.done():
        return None
    return future.result()


def validate_spec(
    spec: GrammarSpec,
    *,
    max_bytes: int = MAX_SPEC_BYTES,
    max_depth: int = MAX_NESTING_DEPTH,
    max_alternatives: int = MAX_REGEX_ALTERNATIVES,
) -> None:
    """Cheap checks before compiling; raises :class:`GrammarError` naming the problem.

    Rejects NUL bytes, specs over ``max_bytes`` (UTF-8), JSON that does not parse, bracket nesting
    deeper than ``max_depth`` (counted without recursion), regexes with more than
    ``max_alternatives`` ``|`` branches, and counted repetitions that unroll past
    ``MAX_EXPANDED_SIZE`` (in regexes, schema ``pattern`` strings and schema size keywords).
    """
    text = spec.text
    if "\x00" in text:
        raise GrammarError(f"{spec.kind.value} grammar contains a NUL byte")
    if len(text) > max_bytes or len(text.encode("utf-8", errors="replace")) > max_bytes:
        raise GrammarError(f"{spec.kind.value} grammar is larger than {max_bytes} bytes")
    if spec.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.STRUCTURAL_TAG):
        _check_depth(json_nesting_depth(text), max_depth, spec.kind)
        _check_json_sizes(_check_json(text, spec.kind))
    elif spec.kind is GrammarKind.REGEX:
        depth, alternatives = regex_shape(text)
        _check_depth(depth, max_depth, spec.kind)
        if alternatives > max_alternatives:
            raise GrammarError(f"regex has {alternatives} alternatives; the limit is {max_alternatives}")
        _check_regex_size(text)
    elif spec.kind is GrammarKind.EBNF:
        _check_depth(ebnf_nesting_depth(text), max_depth, spec.kind)


def _check_depth(depth: int, max_depth: int, kind: GrammarKind) -> None:
    if depth > max_depth:
        raise GrammarError(f"{kind.value} grammar nests {depth} levels deep; the limit is {max_depth}")


def _check_json(text: str, kind: GrammarKind) -> object:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise GrammarError(f"{kind.value} is not valid JSON: {exc}") from exc
    if kind is GrammarKind.JSON_SCHEMA and not isinstance(value, (dict, bool)):
        raise GrammarError("json_schema must be a JSON object or boolean")
    return value


def _check_json_sizes(value: object) -> None:
    """Bound size keywords and ``pattern`` regexes anywhere in a schema (iterative walk)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for key, item in node.items():
                if key in _SIZE_KEYWORDS and isinstance(item, int) and item > MAX_EXPANDED_SIZE:
                    raise GrammarError(f"{key} {item} exceeds the limit of {MAX_EXPANDED_SIZE}")
                if key == "pattern" and isinstance(item, str):
                    _check_regex_size(item)
                stack.append(item)


def _check_regex_size(text: str) -> None:
    size = regex_expanded_size(text)
    if size > MAX_EXPANDED_SIZE:
        raise GrammarError(f"regex unrolls to about {size} items; the limit is {MAX_EXPANDED_SIZE}")


def regex_expanded_size(text: str) -> int:
    """Rough size of a regex once counted repetitions ``{m,n}`` are unrolled (iterative scan)."""
    sums = [0]  # running size per open group
    last = 0  # size of the last atom or group, which a quantifier repeats
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i, last = i + 2, 1
            sums[-1] += 1
            continue
        if ch == "[":
            i = _class_end(text, i)
            last = 1
            sums[-1] += 1
            continue
        if ch == "(":
            sums.append(0)
        elif ch == ")" and len(sums) > 1:
            last = sums.pop()
            sums[-1] += last
        elif ch == "{" and (bound := _repeat_bound(text, i)) is not None:
            sums[-1] += last * (bound[1] - 1)
            last *= bound[1]
            i = bound[0]
            continue
        elif ch not in "|*+?":
            last = 1
            sums[-1] += 1
        i += 1
    return sum(sums)


def _class_end(text: str, start: int) -> int:
    """Index just past the character class opening at ``start``."""
    i = start + 1
    while i < len(text) and text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _repeat_bound(text: str, start: int) -> tuple[int, int] | None:
    """(index past ``}``, largest count) of a ``{m}``/``{m,n}``/``{m,}`` quantifier, or None."""
    close = text.find("}", start)
    body = text[start + 1 : close] if close > 0 else ""
    parts = body.split(",")
    if (
        not body
        or len(parts) > 2
        or not all(p.isdigit() or (p == "" and k == 1) for k, p in enumerate(parts))
    ):
        return None
    return close + 1, max(int(p) for p in parts if p)


def json_nesting_depth(text: str) -> int:
    """Deepest ``{``/``[`` nesting of JSON text, ignoring brackets inside strings (iterative)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "}]":
            depth -= 1
    return deepest


def regex_shape(text: str) -> tuple[int, int]:
    """Deepest group nesting and number of ``|`` branches of a regex (escapes and classes skipped)."""
    depth = deepest = alternatives = 0
    in_class = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
        elif ch == "|":
            alternatives += 1
    return deepest, alternatives


def ebnf_nesting_depth(text: str) -> int:
    """Deepest parenthesis nesting of an EBNF grammar, skipping quoted literals and classes."""
    depth = deepest = 0
    closer = ""  # '"' inside a literal, "]" inside a character class
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif closer:
            closer = "" if ch == closer else closer
        elif ch in '"[':
            closer = '"' if ch == '"' else "]"
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    return deepest
