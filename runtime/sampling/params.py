"""Sampling parameters of one request, with SGLang's wire names and defaults (docs/design.md §8).

:class:`SamplingParams` is built and validated once, where a request enters the engine (the HTTP
body or an ``Engine`` call): construction checks and normalizes every field, and
:meth:`SamplingParams.from_wire` additionally rejects unknown keys. Every problem is an
:class:`~phloem.runtime.errors.InvalidRequest` naming the field, e.g.
``sampling_params.top_p: must be in (0, 1], got 0``.

It is a ``msgspec.Struct``, so it crosses to the scheduler process as itself, a field of the
tokenized request message. msgspec runs ``__post_init__`` when it decodes a struct too; the checks
are skipped there (:func:`decoding_trusted`), since the sending process built the value already.

Choices beyond SGLang's contract:

- ``None`` for a field whose default is not ``None`` means "use the default" (clients often send
  explicit nulls).
- ``top_k == 0`` means "off", like ``-1``; it is stored as ``-1``.
- Integers are accepted for float fields; booleans are never numbers, and numbers never booleans.
- ``json_schema`` and ``structural_tag`` may be given as objects; they are stored as JSON text.
- ``logit_bias`` keys may be ints or digit strings; they are stored as ints. Keys are checked
  against the vocabulary later, by :meth:`SamplingParams.validate_vocab`.
- A ``stop_regex`` that matches the empty string is rejected (it would stop every request at once).
- ``logprob_mode`` (phloem's own field) picks the distribution output logprobs are read from:
  ``"raw"`` (default), the model's own ``log_softmax(logits)``, or ``"processed"``, the one the
  token was drawn from (see :data:`LOGPROB_MODES`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import msgspec
from phloem.runtime.errors import InvalidRequest

PREFIX = "sampling_params"
MAX_N = 64
MAX_STOP_ENTRIES = 32
MAX_STOP_CHARS = 1024  # longer stop strings would make every stop check decode a huge window
GREEDY_EPS = 1e-6  # temperatures below this are greedy
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
# Which distribution output logprobs come from. "raw": log_softmax of the model's logits, before
# any sampling transform (what a trainer recomputes from the same weights). "processed": after
# grammar masks, banned tokens, logit bias, penalties, temperature and top-k/top-p/min-p (the
# distribution the token was actually drawn from; greedy rows skip temperature and truncation).
LOGPROB_MODES = ("raw", "processed")
_INT64_MAX = (1 << 63) - 1


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How to sample one request. Field names and defaults follow SGLang's ``sampling_params``."""

    max_new_tokens: int = 128  # 0: prefill only
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[int, float] | None = None
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None  # accepted and ignored
    stream_interval: int | None = None
    logprob_mode: str = "raw"  # one of LOGPROB_MODES

    def __post_init__(self) -> None:
        if _TRUSTED.get():
            return
        for name, default in _DEFAULTS.items():
            value = getattr(self, name)
            # None means the default; any other value is type-checked and stored normalized
            value = default if value is None else _NORMALIZERS[name](f"{PREFIX}.{name}", value)
            msgspec.structs.force_setattr(self, name, value)
        _check_relations(self)

    # ------------------------------------------------------------------ wire
    @classmethod
    def from_wire(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Parse and validate a ``sampling_params`` object as it arrives on the wire.

        Raises
        ------
        InvalidRequest
            On an unknown key, a value of the wrong type, or a value out of range.
        """
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise InvalidRequest(PREFIX, f"must be an object, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in _DEFAULTS)
        if unknown:
            raise InvalidRequest(f"{PREFIX}.{unknown[0]}", f"unknown field(s): {', '.join(unknown)}")
        return cls(**d)

    def to_wire(self) -> dict[str, Any]:
        """The fields that differ from their defaults, JSON-compatible; ``from_wire`` inverts it."""
        wire = msgspec.to_builtins(self, str_keys=True)
        return {name: value for name, value in wire.items() if getattr(self, name) != _DEFAULTS[name]}

    def validate_vocab(self, vocab_size: int) -> None:
        """Check token ids (``stop_token_ids``, ``logit_bias`` keys) against the vocabulary."""
        if self.stop_token_ids:
            validate_token_ids(self.stop_token_ids, vocab_size, f"{PREFIX}.stop_token_ids")
        for tok in self.logit_bias or ():
            if tok >= vocab_size:
                raise InvalidRequest(
                    f"{PREFIX}.logit_bias", f"token id {tok} is out of range [0, {vocab_size})"
                )

    # ------------------------------------------------------------------ normalized views
    @property
    def stop_strs(self) -> tuple[str, ...]:
        """Stop strings as a tuple (empty when none)."""
        return _as_tuple(self.stop)

    @property
    def stop_regexes(self) -> tuple[str, ...]:
        """Stop regular expressions as a tuple (empty when none)."""
        return _as_tuple(self.stop_regex)

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature ~0 or ``top_k == 1``)."""
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def grammar(self) -> tuple[str, str] | None:
        """``(kind, text)`` of the grammar constraint, kind one of :data:`GRAMMAR_KINDS`; or None."""
        for kind in GRAMMAR_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in msgspec.structs.fields(SamplingParams)}
# True while a message from another phloem process is decoded (see decoding_trusted).
_TRUSTED: ContextVar[bool] = ContextVar("sampling_params_trusted", default=False)


@contextmanager
def decoding_trusted() -> Iterator[None]:
    """Within this block, building a SamplingParams skips its checks.

    For decoding messages between phloem's own processes only: the sender built (and so
    validated) every SamplingParams they carry, where the request entered the engine.
    """
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def validate_token_ids(ids: Iterable[Any], vocab_size: int, field: str) -> None:
    """Raise :class:`InvalidRequest` unless every id is an int in ``[0, vocab_size)``.

    Parameters
    ----------
    ids : iterable
        The token ids to check.
    vocab_size : int
        Size of the model's vocabulary.
    field : str
        Dotted field name used in the error (``"input_ids"``, ``"sampling_params.stop_token_ids"``).
    """
    for i, tok in enumerate(ids):
        if not _is_int(tok):
            raise InvalidRequest(f"{field}[{i}]", f"must be an integer token id, got {_show(tok)}")
        if not 0 <= tok < vocab_size:
            raise InvalidRequest(f"{field}[{i}]", f"token id {tok} is out of range [0, {vocab_size})")


# ---------------------------------------------------------------------- per-field normalization
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(v: Any) -> str:
    return (
        repr(v) if isinstance(v, str) else str(v) if _is_int(v) or isinstance(v, float) else type(v).__name__
    )


def _int(field: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    """An integer in ``[lo, hi]``; without bounds, within int64, which every integer crossing to
    the scheduler (msgpack) and into a tensor must fit."""
    if not _is_int(v):
        raise InvalidRequest(field, f"must be an integer, got {_show(v)}")
    lo = -_INT64_MAX - 1 if lo is None else lo
    hi = _INT64_MAX if hi is None else hi
    if v < lo:
        raise InvalidRequest(field, f"must be >= {lo}, got {v}")
    if v > hi:
        raise InvalidRequest(field, f"must be <= {hi}, got {v}")
    return int(v)


def _float(field: str, v: Any) -> float:
    if not (_is_int(v) or isinstance(v, float)):
        raise InvalidRequest(field, f"must be a number, got {_show(v)}")
    if not math.isfinite(v):
        raise InvalidRequest(field, f"must be finite, got {v}")
    return float(v)


def _bool(field: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise InvalidRequest(field, f"must be a boolean, got {_show(v)}")
    return v


def _in_range(field: str, v: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    x = _float(field, v)
    if (x <= lo if lo_open else x < lo) or x > hi:
        raise InvalidRequest(field, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}")
    return x


def _temperature(field: str, v: Any) -> float:
    x = _float(field, v)
    if x < 0:
        raise InvalidRequest(field, f"must be >= 0, got {v}")
    return x


def _top_k(field: str, v: Any) -> int:
    k = _int(field, v)
    if k < -1:
        raise InvalidRequest(field, f"must be -1 (off) or >= 1, got {v}")
    return -1 if k == 0 else k


def _str_list(field: str, v: Any) -> list[str]:
    """A string or a list of strings, as a list; checks count and emptiness."""
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)):
        raise InvalidRequest(field, f"must be a string or a list of strings, got {_show(v)}")
    if len(items) > MAX_STOP_ENTRIES:
        raise InvalidRequest(field, f"at most {MAX_STOP_ENTRIES} entries, got {len(items)}")
    for i, s in enumerate(items):
        where = field if isinstance(v, str) else f"{field}[{i}]"
        if not isinstance(s, str):
            raise InvalidRequest(where, f"must be a string, got {_show(s)}")
        if not s:
            raise InvalidRequest(where, "must not be empty")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(where, f"at most {MAX_STOP_CHARS} characters, got {len(s)}")
    return list(items)


def _stop(field: str, v: Any) -> str | list[str]:
    items = _str_list(field, v)
    return v if isinstance(v, str) else items


def _stop_regex(field: str, v: Any) -> str | list[str]:
    items = _str_list(field, v)
    for i, pattern in enumerate(items):
        where = field if isinstance(v, str) else f"{field}[{i}]"
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise InvalidRequest(where, f"invalid regular expression: {exc}") from None
        if compiled.fullmatch("") is not None:
            raise InvalidRequest(where, "must not match the empty string")
    return v if isinstance(v, str) else items


def _id_list(field: str, v: Any) -> list[int]:
    if not isinstance(v, (list, tuple)):
        raise InvalidRequest(field, f"must be a list of token ids, got {_show(v)}")
    return [_int(f"{field}[{i}]", t, lo=0) for i, t in enumerate(v)]


def _grammar_text(field: str, v: Any) -> str:
    if not isinstance(v, str):
        raise InvalidRequest(field, f"must be a string, got {_show(v)}")
    if not v.strip():
        raise InvalidRequest(field, "must not be empty")
    return v


def _json_text(field: str, v: Any, *, allowed: tuple[type, ...]) -> str:
    """JSON text of ``v``: objects are serialized, strings must parse to one of ``allowed``."""
    try:
        if isinstance(v, dict):
            return json.dumps(v, ensure_ascii=False)
        if not isinstance(v, str):
            raise InvalidRequest(field, f"must be a JSON string or an object, got {_show(v)}")
        parsed = json.loads(v)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(field, f"invalid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest(field, "nested too deeply") from None
    if not isinstance(parsed, allowed):
        raise InvalidRequest(field, f"must be a JSON {' or '.join(t.__name__ for t in allowed)}")
    return v


def _json_schema(field: str, v: Any) -> str:
    return _json_text(field, v, allowed=(dict, bool))


def _structural_tag(field: str, v: Any) -> str:
    return _json_text(field, v, allowed=(dict,))


def _logit_bias(field: str, v: Any) -> dict[int, float]:
    if not isinstance(v, dict):
        raise InvalidRequest(field, f"must be an object mapping token ids to numbers, got {_show(v)}")
    out: dict[int, float] = {}
    for key, bias in v.items():
        if isinstance(key, str) and key.isascii() and key.isdigit():
            tok = int(key)
        elif _is_int(key) and key >= 0:
            tok = key
        else:
            raise InvalidRequest(field, f"keys must be token ids (non-negative integers), got {key!r}")
        if not (_is_int(bias) or isinstance(bias, float)) or not math.isfinite(bias):
            raise InvalidRequest(field, f"value for token {tok} must be a finite number, got {_show(bias)}")
        out[tok] = float(bias)
    return out


def _seed(field: str, v: Any) -> int:
    return _int(field, v, lo=-_INT64_MAX - 1, hi=_INT64_MAX)


def _logprob_mode(field: str, v: Any) -> str:
    if v not in LOGPROB_MODES:
        raise InvalidRequest(field, f"must be one of {', '.join(map(repr, LOGPROB_MODES))}, got {_show(v)}")
    return str(v)


def _dict(field: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise InvalidRequest(field, f"must be an object, got {_show(v)}")
    try:  # it travels to the scheduler inside the request's message
        msgspec.msgpack.encode(v)
    except (OverflowError, TypeError, ValueError) as exc:
        raise InvalidRequest(field, f"cannot be sent on: {exc}") from None
    return v


_NORMALIZERS: dict[str, Any] = {
    "max_new_tokens": lambda f, v: _int(f, v, lo=0),
    "min_new_tokens": lambda f, v: _int(f, v, lo=0),
    "stop": _stop,
    "stop_token_ids": _id_list,
    "stop_regex": _stop_regex,
    "temperature": _temperature,
    "top_p": lambda f, v: _in_range(f, v, 0.0, 1.0, lo_open=True),
    "top_k": _top_k,
    "min_p": lambda f, v: _in_range(f, v, 0.0, 1.0),
    "frequency_penalty": lambda f, v: _in_range(f, v, -2.0, 2.0),
    "presence_penalty": lambda f, v: _in_range(f, v, -2.0, 2.0),
    "repetition_penalty": lambda f, v: _in_range(f, v, 0.0, 2.0, lo_open=True),
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "no_stop_trim": _bool,
    "n": lambda f, v: _int(f, v, lo=1, hi=MAX_N),
    "json_schema": _json_schema,
    "regex": _grammar_text,
    "ebnf": _grammar_text,
    "structural_tag": _structural_tag,
    "logit_bias": _logit_bias,
    "sampling_seed": _seed,
    "custom_params": _dict,
    "stream_interval": lambda f, v: _int(f, v, lo=1),
    "logprob_mode": _logprob_mode,
}


def _check_relations(p: SamplingParams) -> None:
    """Constraints between fields, checked after each field is normalized."""
    if p.min_new_tokens > p.max_new_tokens:
        raise InvalidRequest(
            f"{PREFIX}.min_new_tokens",
            f"must be <= max_new_tokens ({p.max_new_tokens}), got {p.min_new_tokens}",
        )
    given = [kind for kind in GRAMMAR_KINDS if getattr(p, kind) is not None]
    if len(given) > 1:
        raise InvalidRequest(f"{PREFIX}.{given[1]}", f"at most one of {', '.join(GRAMMAR_KINDS)} may be set")


def _as_tuple(v: str | list[str] | None) -> tuple[str, ...]:
    if v is None:
        return ()
    return (v,) if isinstance(v, str) else tuple(v)
