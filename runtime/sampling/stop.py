"""Stop conditions, checked by the scheduler after every step (docs/design.md §2, step 6).

A step may append several tokens (speculative decoding, jump-forward), so each condition is
located at the token that triggers it and the earliest one wins; on a tie the order is
stop strings, stop regex, stop token ids / EOS, length. Tokens after the trigger are surplus:
:attr:`FinishReason.keep` says how many output tokens to keep.

``min_new_tokens``: a stop token (EOS or ``stop_token_ids``) counts only once more than
``min_new_tokens`` tokens are out (the sampler bans those tokens before then, so both agree); a
stop string or regex counts once at least ``min_new_tokens`` tokens are out. ``ignore_eos``
ignores EOS only: explicit ``stop_token_ids`` still stop.

Text conditions decode only a tail window: enough tokens before the new ones to hold the longest
stop string (each token is at least one byte), or :data:`REGEX_WINDOW_TOKENS` for regexes, which
therefore see a bounded tail (``^`` anchors at the window's start).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from phloem.runtime.sampling.params import SamplingParams

REGEX_WINDOW_TOKENS = 64
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class FinishReason:
    """Why a request finished, with SGLang's wire shapes.

    ``tail_chars`` and ``keep`` are for the runtime only (not on the wire): the matched stop string
    ends ``tail_chars`` characters before the end of the output text, and only the first ``keep``
    output tokens belong to the output (None: all of them).
    """

    kind: str  # "stop" | "length" | "abort"
    matched: str | int | None = None
    num_tokens: int | None = None  # the length limit, for kind == "length"
    message: str | None = None
    status_code: int | None = None  # for kind == "abort": the HTTP status that fits, if known
    param: str | None = None  # for kind == "abort": the request field at fault (wire name), if known
    tail_chars: int = 0
    keep: int | None = None

    @classmethod
    def stop_matched(
        cls, matched: str | int, *, tail_chars: int = 0, keep: int | None = None
    ) -> FinishReason:
        return cls("stop", matched=matched, tail_chars=tail_chars, keep=keep)

    @classmethod
    def length(cls, n: int, *, keep: int | None = None) -> FinishReason:
        return cls("length", num_tokens=n, keep=keep)

    @classmethod
    def abort(cls, message: str, *, status_code: int | None = None, param: str | None = None) -> FinishReason:
        return cls("abort", message=message, status_code=status_code, param=param)

    def to_wire(self) -> dict[str, Any]:
        """``{"type": "stop", "matched": m}`` | ``{"type": "length", "length": n}`` |
        ``{"type": "abort", "message": m}`` (plus ``"status_code"`` and ``"param"`` when known)."""
        if self.kind == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.kind == "length":
            return {"type": "length", "length": self.num_tokens}
        wire: dict[str, Any] = {"type": "abort", "message": self.message}
        if self.status_code is not None:
            wire["status_code"] = self.status_code
        if self.param is not None:
            wire["param"] = self.param
        return wire

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> FinishReason:
        kind = d.get("type")
        if kind == "stop":
            return cls("stop", matched=d.get("matched"))
        if kind == "length":
            return cls("length", num_tokens=d.get("length"))
        if kind == "abort":
            return cls.abort(d.get("message") or "", status_code=d.get("status_code"), param=d.get("param"))
        raise ValueError(f"unknown finish reason type {kind!r}")


class _Decoder(Protocol):
    def decode(
        self, ids: list[int], *, skip_special_tokens: bool = ..., spaces_between_special_tokens: bool = ...
    ) -> str: ...


# A finder returns (start, end, matched text) of the earliest match in `text` ending after
# `boundary`, or None.
_Finder = Callable[[str, int], "tuple[int, int, str] | None"]


class StopChecker:
    """Per-request stop conditions.

    Parameters
    ----------
    params : SamplingParams
        The request's parameters.
    eos_token_ids : iterable of int
        The model's EOS ids (ignored with ``params.ignore_eos``).
    tokenizer : object, optional
        Needed only when ``params`` has stop strings or stop regexes; ``decode`` as in
        :class:`~phloem.runtime.tokenizer.detokenizer.IncrementalDecoder`.
    """

    def __init__(
        self, params: SamplingParams, *, eos_token_ids: Iterable[int] = (), tokenizer: _Decoder | None = None
    ) -> None:
        self.params = params
        self.stop_strs = params.stop_strs
        self.stop_regexes = tuple(re.compile(p) for p in params.stop_regexes)
        eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids or ()) | eos
        if (self.stop_strs or self.stop_regexes) and tokenizer is None:
            raise ValueError("stop strings and stop regexes need a tokenizer")
        self._tokenizer = tokenizer
        self._decode_kwargs = {
            "skip_special_tokens": params.skip_special_tokens,
            "spaces_between_special_tokens": params.spaces_between_special_tokens,
        }
        # One new token and only token stops: the per-token decode loop takes a short path.
        self._tokens_only = not (self.stop_strs or self.stop_regexes)
        self._max_new_tokens = params.max_new_tokens
        longest = max((len(s.encode("utf-8")) for s in self.stop_strs), default=0)
        self._str_window = longest + 4  # tokens; slack for split characters and skipped specials

    def check(self, output_ids: Sequence[int], num_new: int = 1) -> FinishReason | None:
        """The reason to finish now, or None.

        Parameters
        ----------
        output_ids : sequence of int
            Every output token so far, including this step's.
        num_new : int
            How many of them this step added (at the end).
        """
        n = len(output_ids)
        if num_new == 1 and self._tokens_only:
            # Most decode steps end here: under the limit and not a stop token (no call made).
            if n < self._max_new_tokens and output_ids[-1] not in self.stop_token_ids:
                return None
            return self._check_one_token(output_ids, n)
        first_new = n - num_new
        floor = self.params.min_new_tokens
        candidates: list[tuple[int, int, FinishReason]] = []  # (keep, priority, reason)
        text_from = max(first_new, floor - 1, 0)
        if self.stop_strs and text_from < n:
            self._add_text(candidates, 0, output_ids, text_from, self._str_window, self._find_string)
        if self.stop_regexes and text_from < n:
            self._add_text(candidates, 1, output_ids, text_from, REGEX_WINDOW_TOKENS, self._find_regex)
        token = self._first_stop_token(output_ids, max(first_new, floor))
        if token is not None:
            candidates.append(token)
        if n >= self.params.max_new_tokens:
            limit = self.params.max_new_tokens
            candidates.append((limit, 3, FinishReason.length(limit, keep=limit)))
        if not candidates:
            return None
        return min(candidates, key=lambda c: (c[0], c[1]))[2]

    def _check_one_token(self, output_ids: Sequence[int], n: int) -> FinishReason | None:
        """``check`` for one new token and no text stops (same precedence: the earlier ``keep``
        wins, a stop token before the length limit at equal ``keep``)."""
        limit = self.params.max_new_tokens
        token = output_ids[-1]
        if token in self.stop_token_ids and n - 1 >= self.params.min_new_tokens and n <= limit:
            return FinishReason.stop_matched(token, keep=n)
        if n >= limit:
            return FinishReason.length(limit, keep=limit)
        return None

    # ------------------------------------------------------------------ token stops
    def _first_stop_token(self, ids: Sequence[int], lo: int) -> tuple[int, int, FinishReason] | None:
        stops = self.stop_token_ids
        for i in range(lo, len(ids)):
            if ids[i] in stops:
                return i + 1, 2, FinishReason.stop_matched(ids[i], keep=i + 1)
        return None

    # ------------------------------------------------------------------ text stops
    def _add_text(
        self,
        candidates: list[tuple[int, int, FinishReason]],
        priority: int,
        ids: Sequence[int],
        lo: int,
        window: int,
        find: _Finder,
    ) -> None:
        """Locate the earliest text stop completed by the tokens ``ids[lo:]``.

        Decodes ``ids[start:lo]`` (text already checked) and ``ids[start:k]`` for growing ``k``;
        a match counts when it ends past the stable part of the already-checked text.
        """
        start = max(0, lo - window)
        boundary = len(self._decode(ids[start:lo]).rstrip(_REPLACEMENT)) if lo > start else 0
        text = self._decode(ids[start:])
        if find(text, boundary) is None:
            return
        keep = len(ids)
        for k in range(lo + 1, len(ids)):  # several new tokens: find the one that completes it
            prefix_text = self._decode(ids[start:k])
            if find(prefix_text, boundary) is not None:
                keep, text = k, prefix_text
                break
        begin, end, matched = find(text, boundary)  # type: ignore[misc]
        reason = FinishReason.stop_matched(matched, tail_chars=len(text) - end, keep=keep)
        candidates.append((keep, priority, reason))

    def _find_string(self, text: str, boundary: int) -> tuple[int, int, str] | None:
        best: tuple[int, int, str] | None = None
        for s in self.stop_strs:
            i = text.find(s, max(0, boundary - len(s) + 1))
            if i >= 0 and (best is None or (i, i + len(s)) < best[:2]):
                best = (i, i + len(s), s)
        return best

    def _find_regex(self, text: str, boundary: int) -> tuple[int, int, str] | None:
        best: tuple[int, int, str] | None = None
        for pattern in self.stop_regexes:
            for m in pattern.finditer(text):
                if m.end() > boundary and m.end() > m.start():
                    if best is None or (m.start(), m.end()) < best[:2]:
                        best = (m.start(), m.end(), m.group(0))
                    break
        return best

    def _decode(self, ids: Sequence[int]) -> str:
        assert self._tokenizer is not None
        return self._tokenizer.decode(list(ids), **self._decode_kwargs)
