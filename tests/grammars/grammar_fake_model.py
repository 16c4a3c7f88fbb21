"""A fake "model" for grammar tests: samples among the tokens a matcher's mask allows."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from phloem.grammars.base import GrammarMatcher
from phloem.grammars.bitmask import allocate_bitmask

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB_SIZE = 49152
STOP_TOKEN_IDS = (2, 0)  # <|im_end|>, <|endoftext|>
CLOSERS = set('"}]@')


@dataclass
class TokenClasses:
    """Token ids grouped so the sampler can end strings and containers in reasonable time."""

    closing: np.ndarray  # tokens spelling any of `"`, `}`, `]` or `@`
    short: np.ndarray  # tokens of at most two characters

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int) -> TokenClasses:
        texts = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        closing = [i for i, t in enumerate(texts) if t and CLOSERS & set(t)]
        short = [i for i, t in enumerate(texts) if t and len(t) <= 2]
        return cls(np.asarray(closing), np.asarray(short))


def allowed_tokens(matcher: GrammarMatcher, vocab_size: int) -> np.ndarray:
    """Sorted ids the matcher's mask allows."""
    mask = allocate_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def sample_output(
    matcher: GrammarMatcher,
    *,
    vocab_size: int,
    stop_token_ids: tuple[int, ...],
    classes: TokenClasses,
    seed: int,
    max_tokens: int = 300,
) -> tuple[list[int], bool]:
    """Generate until termination or ``max_tokens``; returns (token ids without the stop, terminated).

    Each step draws uniformly from the allowed set, but first takes an allowed stop token with
    probability 0.6, then with probability 0.3 an allowed token spelling a closing character, then
    with probability 0.5 an allowed short token, so outputs usually finish within the cap. Every
    sampled token must be accepted.
    """
    rng = random.Random(seed)
    output: list[int] = []
    for _ in range(max_tokens):
        allowed = allowed_tokens(matcher, vocab_size)
        assert len(allowed) > 0, "a live matcher allowed no token"
        token = _pick(rng, allowed, stop_token_ids, classes)
        assert matcher.accept_token(token), f"masked-in token {token} was rejected"
        if token in stop_token_ids:
            assert matcher.is_terminated()
            return output, True
        output.append(token)
    return output, False


def _pick(rng: random.Random, allowed: np.ndarray, stops: tuple[int, ...], classes: TokenClasses) -> int:
    stop_allowed = [t for t, ok in zip(stops, np.isin(stops, allowed)) if ok]
    if stop_allowed and rng.random() < 0.6:
        return stop_allowed[0]
    for pool, chance in ((classes.closing, 0.3), (classes.short, 0.5)):
        subset = np.intersect1d(allowed, pool, assume_unique=True)
        if len(subset) and rng.random() < chance:
            return int(subset[rng.randrange(len(subset))])
    return int(allowed[rng.randrange(len(allowed))])
