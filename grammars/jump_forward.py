"""Jump-forward: append text the grammar forces without one forward pass per token.

The forced text is retokenized together with the last few output tokens, so the model keeps
seeing the tokenization it would have produced itself (``{"`` rather than ``{`` + ``"``). The
caller rolls back ``drop_k`` tokens (from the output and from the matcher) and appends ``new_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import GrammarMatcher

DEFAULT_WINDOW = 4
# A jump costs a pass of its own and makes the batch wait for the host: a forced run shorter than
# this many tokens is cheaper to decode.
MIN_JUMP_TOKENS = 4


def find_jump_forward(matcher: GrammarMatcher) -> str:
    """The text the grammar forces next (empty when nothing is forced); the matcher is unchanged."""
    return matcher.find_jump_forward_string()


def retokenize_boundary(
    tokenizer: Any,
    prev_output_ids: Sequence[int],
    forced_text: str,
    *,
    window: int = DEFAULT_WINDOW,
) -> tuple[int, list[int]]:
    """Retokenize the last ``window`` output tokens plus ``forced_text`` canonically.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerFast
        The model's tokenizer.
    prev_output_ids : Sequence[int]
        Output tokens so far (the matcher has accepted all of them).
    forced_text : str
        Text to append (from :func:`find_jump_forward`).
    window : int
        How many trailing tokens may be retokenized.

    Returns
    -------
    tuple[int, list[int]]
        ``(drop_k, new_ids)``: roll back the last ``drop_k`` tokens, then append ``new_ids``.
        Their text equals the dropped tokens' text followed by ``forced_text``.
    """
    if not forced_text:
        return 0, []
    tail = list(prev_output_ids[len(prev_output_ids) - min(window, len(prev_output_ids)) :])
    while tail:
        tail_text = tokenizer.decode(tail)
        if "\ufffd" not in tail_text and _encode(tokenizer, tail_text) == tail:
            break
        tail = tail[1:]  # a split character or a non-canonical start: retokenize less
    tail_text = tokenizer.decode(tail) if tail else ""
    ids = _encode(tokenizer, tail_text + forced_text)
    if tokenizer.decode(ids) != tail_text + forced_text:
        return 0, _encode(tokenizer, forced_text)
    keep = _common_prefix_len(tail, ids)
    return len(tail) - keep, ids[keep:]


def jump_forward(
    matcher: GrammarMatcher,
    tokenizer: Any,
    prev_output_ids: Sequence[int],
    *,
    window: int = DEFAULT_WINDOW,
    min_tokens: int = 1,
    max_tokens: int | None = None,
) -> tuple[int, list[int]]:
    """Find forced text, retokenize it at the boundary and apply it to ``matcher``.

    Mutates ``matcher`` (rolled back ``drop_k``, then advanced over ``new_ids``). When the grammar
    rejects the retokenized ids, or the jump would add fewer than ``min_tokens`` tokens
    (``len(new_ids) - drop_k``), the matcher is left as it was and ``(0, [])`` is returned.

    ``max_tokens`` caps the tokens the jump adds (what is left of the request's budget). A jump
    that appends only forced text is cut to it; one that also rewrote the tail is not taken,
    because its cut ids may spell less text than the tokens they would replace.
    """
    forced = find_jump_forward(matcher)
    drop_k, new_ids = retokenize_boundary(tokenizer, prev_output_ids, forced, window=window)
    if max_tokens is not None and len(new_ids) - drop_k > max_tokens:
        new_ids = [] if drop_k else new_ids[: max(max_tokens, 0)]
    if not new_ids or len(new_ids) - drop_k < min_tokens:
        return 0, []
    dropped = list(prev_output_ids[len(prev_output_ids) - drop_k :]) if drop_k else []
    matcher.rollback(drop_k)
    accepted = matcher.accept_tokens(new_ids)
    if accepted < len(new_ids):
        matcher.rollback(accepted)
        matcher.accept_tokens(dropped)
        return 0, []
    return drop_k, new_ids


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    size = 0
    for x, y in zip(a, b):
        if x != y:
            break
        size += 1
    return size
