"""What text the router routes a request by, and its token estimate."""

from __future__ import annotations

from phloem.runtime.router.request_text import chat_text, estimate_tokens, request_texts


def test_native_text_batches_and_token_ids():
    assert request_texts("/generate", {"text": "abc"}) == ["abc"]
    assert request_texts("/generate", {"text": ["a", "b"]}) == ["a", "b"]
    assert request_texts("/generate", {"input_ids": [1, 2, 3]}) == ["1 2 3 "]
    assert request_texts("/generate", {"input_ids": [[1, 2], [1, 3]]}) == ["1 2 ", "1 3 "]
    # token-id texts that share ids share a prefix, and [1, 2] is no prefix of [1, 23]
    assert not request_texts("/generate", {"input_ids": [1, 23]})[0].startswith("1 2 ")


def test_completion_prompts():
    assert request_texts("/v1/completions", {"prompt": "p"}) == ["p"]
    assert request_texts("/v1/completions", {"prompt": ["p", "q"]}) == ["p", "q"]
    assert request_texts("/v1/completions", {"prompt": [5, 6]}) == ["5 6 "]


def test_chat_messages_render_in_order_with_roles():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]
    text = request_texts("/v1/chat/completions", {"messages": msgs})[0]
    assert text == "<system>S\n<user>U\n"
    longer = chat_text([*msgs, {"role": "assistant", "content": None}])
    assert longer.startswith(text)  # a longer conversation extends the shorter one's text
    assert chat_text([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]).startswith(
        "<user>{"
    )


def test_unreadable_bodies_have_no_text():
    assert request_texts("/generate", None) == []
    assert request_texts("/generate", ["text"]) == []
    assert request_texts("/generate", {"text": 5}) == []
    assert request_texts("/generate", {"text": []}) == []
    assert request_texts("/v1/chat/completions", {"messages": "hi"}) == []
    assert request_texts("/v1/models", {"prompt": "x"}) == []


def test_token_estimate_counts_prompt_characters_and_asked_output():
    assert estimate_tokens({"sampling_params": {"max_new_tokens": 10}}, ["x" * 40]) == 20
    assert estimate_tokens({"max_tokens": 7}, ["a" * 8, "b" * 8]) == 4 + 14
    assert estimate_tokens({"max_completion_tokens": 3}, []) == 3
    assert estimate_tokens(None, ["abcd"]) == 1
