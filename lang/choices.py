"""Scoring for ``select()``: pure functions over per-token log probabilities.

A backend returns, for each choice, the log probabilities of the choice's tokens given the prefix
(``conditional``) and, when a method asks for it, given an almost empty context (``unconditional``).
Everything here is arithmetic on those numbers; nothing talks to a model.

Token healing: when ``prefix + choice`` tokenizes so that the last prefix token merges with the start of
the choice (``"Answer: "`` + ``"yes"`` -> ``... "Answer:" " yes"``), the choice is scored from the first
token where the two tokenizations differ, so the merged token is scored given the shortened prefix.
:func:`healed_boundary` finds that position.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TokenLogprobs = Sequence[float]


@dataclass(frozen=True, kw_only=True)
class ChoiceLogprobs:
    """Per-choice token log probabilities, in choice order."""

    conditional: tuple[tuple[float, ...], ...]
    unconditional: tuple[tuple[float, ...], ...] | None = None


@dataclass(frozen=True, kw_only=True)
class SelectDecision:
    """The outcome of scoring: the chosen index and the score of every choice."""

    index: int
    scores: tuple[float, ...]
    method: str


def healed_boundary(prefix_ids: Sequence[int], full_ids: Sequence[int]) -> int:
    """Index of the first token of ``full_ids`` that belongs to the choice.

    That is the length of the common prefix of the two tokenizations: ``len(prefix_ids)`` normally,
    smaller when the choice's tokenization merged with the end of the prefix (token healing).
    """
    limit = min(len(prefix_ids), len(full_ids))
    for i in range(limit):
        if prefix_ids[i] != full_ids[i]:
            return i
    return limit


def tail_logprobs(entries: Sequence[Sequence], count: int) -> tuple[float, ...]:
    """Log probabilities of the last ``count`` input tokens from ``[logprob, token_id, text]`` triples.

    Entries without a log probability (the first token of a sequence) are dropped.
    """
    tail = entries[len(entries) - count :] if count > 0 else []
    return tuple(float(e[0]) for e in tail if e[0] is not None)


def mean_logprob(logprobs: TokenLogprobs) -> float:
    """Average token log probability; ``-inf`` for an empty choice."""
    return sum(logprobs) / len(logprobs) if logprobs else -math.inf


def token_length_normalized_scores(lp: ChoiceLogprobs) -> list[float]:
    """Mean log probability of each choice's tokens given the prefix."""
    return [mean_logprob(c) for c in lp.conditional]


def unconditional_normalized_scores(lp: ChoiceLogprobs) -> list[float]:
    """``log P(choice | prefix) - log P(choice | empty context)`` for each choice.

    Divides out how likely a choice is on its own, so frequent short answers do not win by default.
    """
    if lp.unconditional is None:
        raise ValueError("unconditional_likelihood_normalized needs unconditional log probabilities")
    return [sum(c) - sum(u) for c, u in zip(lp.conditional, lp.unconditional, strict=True)]


def greedy_index(conditional: Sequence[TokenLogprobs]) -> int:
    """The choice greedy decoding would follow, position by position.

    At each token position keep only the choices whose token has the highest log probability there;
    stop when one is left. A choice shorter than the others continues with its own mean log
    probability, so it neither wins nor loses just by ending. Remaining ties go to the first choice.
    """
    alive = list(range(len(conditional)))
    width = max((len(c) for c in conditional), default=0)
    for pos in range(width):
        at = {i: _padded(conditional[i], pos) for i in alive}
        best = max(at.values())
        alive = [i for i in alive if at[i] >= best - 1e-9]
        if len(alive) == 1:
            break
    return alive[0]


def _padded(logprobs: TokenLogprobs, pos: int) -> float:
    return logprobs[pos] if pos < len(logprobs) else mean_logprob(logprobs)


def softmax(scores: Sequence[float], *, temperature: float) -> list[float]:
    """``softmax(scores / temperature)``, stable for ``-inf`` scores."""
    scaled = [s / temperature for s in scores]
    top = max(scaled)
    if top == -math.inf:
        return [1.0 / len(scaled)] * len(scaled)
    weights = [math.exp(s - top) for s in scaled]
    total = sum(weights)
    return [w / total for w in weights]


def argmax(scores: Sequence[float]) -> int:
    """First index of the largest score."""
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


@dataclass(frozen=True, kw_only=True)
class ChoicesMethod:
    """A named way to score choices.

    ``scores`` maps log probabilities to one score per choice; ``pick`` chooses the greedy (temperature
    0) winner, by default the argmax of the scores.
    """

    name: str
    needs_unconditional: bool
    scores: Callable[[ChoiceLogprobs], list[float]]
    pick: Callable[[ChoiceLogprobs, list[float]], int] = lambda lp, scores: argmax(scores)

    def decide(
        self, lp: ChoiceLogprobs, *, temperature: float = 0.0, rng: random.Random | None = None
    ) -> SelectDecision:
        """Score, then pick greedily (``temperature == 0``) or sample from ``softmax(scores / T)``."""
        scores = self.scores(lp)
        if temperature > 0:
            probs = softmax(scores, temperature=temperature)
            index = (rng or random).choices(range(len(scores)), weights=probs)[0]
        else:
            index = self.pick(lp, scores)
        return SelectDecision(index=index, scores=tuple(scores), method=self.name)

    def __repr__(self) -> str:
        return self.name


token_length_normalized = ChoicesMethod(
    name="token_length_normalized", needs_unconditional=False, scores=token_length_normalized_scores
)
"""Default: the choice with the highest mean token log probability."""

greedy_token_selection = ChoicesMethod(
    name="greedy_token_selection",
    needs_unconditional=False,
    scores=token_length_normalized_scores,
    pick=lambda lp, scores: greedy_index(lp.conditional),
)
"""The choice greedy decoding would produce (see :func:`greedy_index`); scores are mean log probs."""

unconditional_likelihood_normalized = ChoicesMethod(
    name="unconditional_likelihood_normalized",
    needs_unconditional=True,
    scores=unconditional_normalized_scores,
)
"""The choice whose likelihood rises most because of the prefix (needs a second, context-free request)."""

METHODS: dict[str, ChoicesMethod] = {
    m.name: m for m in (token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized)
}


def resolve_method(method: ChoicesMethod | str | None) -> ChoicesMethod:
    """Accept a method object or its name; ``None`` means the default."""
    if method is None:
        return token_length_normalized
    if isinstance(method, ChoicesMethod):
        return method
    try:
        return METHODS[method]
    except KeyError:
        raise ValueError(f"unknown choices_method {method!r}; known: {sorted(METHODS)}") from None
