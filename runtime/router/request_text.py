"""The text a request is routed by, and a rough estimate of its tokens (for the token load).

Only the prompt matters to the cache: a native ``text`` (one or a batch), ``input_ids`` written as
numbers, a completion ``prompt``, or chat ``messages`` rendered to one canonical string (role and
content of each message, in order: two requests that share their first messages share a prefix).
A body the router cannot read gives no text; the worker answers it with its own 400.
"""

from __future__ import annotations

import json
from typing import Any

CHARS_PER_TOKEN = 4  # English text in a BPE vocabulary; only loads are compared, so rough is enough


def _ids(ids: Any) -> str:
    return " ".join(str(i) for i in ids) + " "


def _prompts(value: Any) -> list[str]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(isinstance(v, int) for v in value):
            return [_ids(value)]
        if all(isinstance(v, list) for v in value):
            return [_ids(v) for v in value]
    return []


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # parts: text as is, anything else (images) as its JSON
        return "".join(
            p["text"]
            if isinstance(p, dict) and isinstance(p.get("text"), str)
            else json.dumps(p, sort_keys=True)
            for p in content
        )
    return "" if content is None else json.dumps(content, sort_keys=True)


def chat_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for m in messages:
        if isinstance(m, dict):
            parts.append(f"<{m.get('role', '')}>{_content(m.get('content'))}\n")
    return "".join(parts)


def request_texts(route: str, body: Any) -> list[str]:
    """The texts of a parsed JSON ``body`` sent to ``route``; [] when it has none."""
    if not isinstance(body, dict):
        return []
    if route == "/generate":
        texts = _prompts(body.get("text"))
        return texts or _prompts(body.get("input_ids"))
    if route == "/v1/completions":
        return _prompts(body.get("prompt"))
    if route == "/v1/chat/completions":
        text = chat_text(body.get("messages"))
        return [text] if text else []
    return []


def estimate_tokens(body: Any, texts: list[str]) -> int:
    """Prompt tokens (from the characters) plus the output tokens asked for, per prompt."""
    prompt = sum(len(t) for t in texts) // CHARS_PER_TOKEN
    out = 0
    if isinstance(body, dict):
        params = body.get("sampling_params")
        for source, key in (
            (params, "max_new_tokens"),
            (body, "max_tokens"),
            (body, "max_completion_tokens"),
        ):
            if isinstance(source, dict) and isinstance(source.get(key), int):
                out = source[key]
                break
    return prompt + out * max(len(texts), 1)
