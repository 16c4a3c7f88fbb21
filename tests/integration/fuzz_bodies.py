"""Hypothesis strategies for hostile request bodies of the native and OpenAI routes.

Each body is well formed as a whole (an object with the route's fields) but any field may hold a
hostile value: a wrong type, a number out of range or not finite, an empty, unicode or control-char
string, a deep nesting, a bad grammar, a long stop list, plus keys the route does not know. What a
generated body may cost is bounded: lengths to generate are drawn from 0..MAX_GEN or from values the
server must refuse (negative, far past the context), never from the expensive middle, and the
route's own default length is never left to apply (chat's default is the whole context).

A body is a plain dict; :func:`encode` turns it into the bytes sent, which may hold ``NaN`` and
``Infinity`` (Python's JSON extension, which clients do send) and nestings deeper than Python's own
encoder can write.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from hypothesis import strategies as st

MAX_GEN = 4  # most tokens a body may ask to generate
VOCAB = 49152  # SmolLM2's vocabulary
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"

# ---- building blocks -----------------------------------------------------------------------------
_DEEP = "__deep_nesting_{}__"
_DEEP_RE = re.compile(r'"__deep_nesting_(\d+)_(\w+)__"')

HUGE_INTS = [2**31, 2**53 + 1, 2**63, 2**64, 10**30, -(2**63) - 1, -(10**30)]
ODD_FLOATS = [float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, -0.0, 1e-7]
ODD_STRINGS = [
    "",
    " ",
    "\x00",
    "\x00\x01\x1b[31m\x7f",
    "\ud7ff\ue000\uffff",
    "\ud800x",  # a lone surrogate: not UTF-8 once encoded
    "💥🧨" * 3,
    "\u202e\u200b\ufeff",
    "a\nb\r\nc\td",
    "\\u0000",
    "null",
    "' OR 1=1 --",
    "{{ template }}",
    "x" * 3000,
]


def deep(depth: int, kind: str = "list") -> str:
    """A placeholder :func:`encode` replaces with ``depth`` nested lists or objects."""
    return _DEEP.format(f"{depth}_{kind}")


def encode(body: Any) -> bytes:
    """The bytes of ``body``: JSON with NaN/Infinity allowed and deep-nesting placeholders expanded."""
    text = json.dumps(body, allow_nan=True, ensure_ascii=False)

    def expand(m: re.Match[str]) -> str:
        depth, kind = int(m.group(1)), m.group(2)
        return ("[" * depth + "]" * depth) if kind == "list" else ('{"a":' * depth + "1" + "}" * depth)

    return _DEEP_RE.sub(expand, text).encode("utf-8", "surrogatepass")


short_text = st.text(min_size=1, max_size=24)
odd_text = st.sampled_from(ODD_STRINGS)
token_id = st.integers(0, VOCAB - 1)
bad_token_id = st.sampled_from([-1, VOCAB, 10**9, *HUGE_INTS]) | st.booleans() | st.floats(allow_nan=True)


def deep_value() -> st.SearchStrategy[str]:
    return st.builds(deep, st.sampled_from([64, 300, 1200, 5000]), st.sampled_from(["list", "object"]))


scalar_junk = (
    st.none()
    | st.booleans()
    | st.sampled_from(HUGE_INTS)
    | st.integers(-5, 5)
    | st.sampled_from(ODD_FLOATS)
    | st.floats()
    | st.sampled_from(ODD_STRINGS)
)
junk: st.SearchStrategy[Any] = st.recursive(
    scalar_junk,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
) | deep_value()


class Field(NamedTuple):
    """A field's strategies: the values the route accepts, and the hostile ones."""

    valid: st.SearchStrategy[Any]
    bad: st.SearchStrategy[Any]


def hostile(valid: st.SearchStrategy[Any], *bad: st.SearchStrategy[Any]) -> Field:
    """A field whose bad values are ``bad`` (field-specific: out of range, odd strings) or junk."""
    return Field(valid, st.one_of(*bad, odd_text, junk))


def value(field: Field) -> st.SearchStrategy[Any]:
    """One value of ``field``, one time in ten a bad one (shrinking goes towards the valid one)."""
    return st.integers(0, 9).flatmap(lambda roll: field.bad if roll == 9 else field.valid)


@st.composite
def fill(
    draw: st.DrawFn, required: dict[str, Field], optional: dict[str, Field], known: set[str]
) -> dict[str, Any]:
    """An object with every ``required`` field and about a quarter of the ``optional`` ones, each
    one time in ten hostile; one time in ten with keys the route does not know."""
    body = {name: draw(value(f)) for name, f in required.items()}
    for name, f in optional.items():
        if draw(st.integers(0, 3)) == 3:
            body[name] = draw(value(f))
    if draw(st.integers(0, 9)) == 9:
        body.update(draw(unknown_keys(known)))
    return body


def gen_len(*, allow_null: bool = False) -> Field:
    """A length to generate: 0..MAX_GEN, or a value that must be refused (never a costly valid one,
    never junk: a null would mean the route's default)."""
    refused = st.sampled_from([-1, -(10**6), 10**7, *HUGE_INTS, "4", 4.0, True, [4], {}])
    return Field(st.integers(0, MAX_GEN), refused | st.none() if allow_null else refused)


def number(lo: float, hi: float) -> Field:
    inside = st.floats(lo, hi, allow_nan=False) | st.integers(int(lo), int(hi))
    return hostile(inside, st.sampled_from(ODD_FLOATS) | st.floats(-1e6, 1e6), st.sampled_from(HUGE_INTS))


def unknown_keys(known: set[str]) -> st.SearchStrategy[dict[str, Any]]:
    keys = (st.text(min_size=1, max_size=12) | st.sampled_from(["temprature", "max_token", "__proto__", ""])).filter(
        lambda k: k not in known
    )
    return st.dictionaries(keys, junk, max_size=2)


# ---- grammars and stops --------------------------------------------------------------------------
GOOD_REGEX = ["[a-z]{1,3}", "yes|no", r"\d+", "(ab)+", "[^\\n]{0,5}"]
BAD_REGEX = ["(", "[", "a{5,2}", "[z-a]", "(?P<x", "*a", "a**", "(?<=a)b", r"\1", "(a|)*", ".*", "", "  "]
GOOD_SCHEMAS: list[Any] = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "maxLength": 3},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    {"enum": ["x", 1, None]},
    True,
]
BAD_SCHEMAS: list[Any] = [
    {"type": "nope"},
    {"$ref": "#/definitions/missing"},
    {"type": "string", "pattern": "("},
    {"type": "integer", "minimum": 5, "maximum": 1},
    {"type": "object", "properties": {"a": {"$ref": "#"}}},
    "{not json",
    "[]",
    "5",
    "",
    [],
    False,
]
GOOD_EBNF = ['root ::= "yes" | "no"', 'root ::= [0-9]+']
BAD_EBNF = ["root ::=", "root ::= missing", "not a grammar", 'root ::= "a" |']

regex_value = hostile(st.sampled_from(GOOD_REGEX), st.sampled_from(BAD_REGEX))
json_schema_value = hostile(
    st.sampled_from(GOOD_SCHEMAS) | st.sampled_from(GOOD_SCHEMAS).map(json.dumps),
    st.sampled_from(BAD_SCHEMAS),
    deep_value(),
    deep_value().map(lambda p: json.dumps({"type": "object", "properties": {"a": p}})),
)
ebnf_value = hostile(st.sampled_from(GOOD_EBNF), st.sampled_from(BAD_EBNF))
stop_value = hostile(
    short_text | st.lists(short_text, max_size=6),
    st.lists(st.text(min_size=1, max_size=3), min_size=30, max_size=80),
    st.just("s" * 2000),
)
stop_regex_value = hostile(st.sampled_from(GOOD_REGEX[:3]), st.sampled_from(BAD_REGEX), st.lists(st.sampled_from(BAD_REGEX)))
token_ids = hostile(st.lists(token_id, max_size=4), st.lists(bad_token_id, min_size=1, max_size=3))
logit_bias_value = hostile(
    st.dictionaries(token_id.map(str) | token_id, st.floats(-100, 100), max_size=3),
    st.dictionaries(st.sampled_from(["-1", "x", str(VOCAB), "1e3", "٣"]), junk, min_size=1, max_size=2),
)
bool_value = hostile(st.booleans(), st.sampled_from([0, 1, "true", "false"]))
small_n = hostile(st.integers(1, 3), st.sampled_from([0, -1, 65, 10**20, 1.5, "2"]))
rid_value = hostile(st.uuids().map(str), st.sampled_from(ODD_STRINGS), st.lists(st.uuids().map(str), max_size=3))


# ---- native /generate ----------------------------------------------------------------------------
SAMPLING_FIELDS: dict[str, Field] = {
    "min_new_tokens": hostile(st.integers(0, MAX_GEN), st.sampled_from([-1, 10**7, *HUGE_INTS])),
    "stop": stop_value,
    "stop_token_ids": token_ids,
    "stop_regex": stop_regex_value,
    "temperature": number(0, 2),
    "top_p": number(0, 1),
    "top_k": hostile(st.integers(-1, 50), st.sampled_from([-2, -(10**6), *HUGE_INTS])),
    "min_p": number(0, 1),
    "frequency_penalty": number(-2, 2),
    "presence_penalty": number(-2, 2),
    "repetition_penalty": number(0, 2),
    "ignore_eos": bool_value,
    "skip_special_tokens": bool_value,
    "spaces_between_special_tokens": bool_value,
    "no_stop_trim": bool_value,
    "n": small_n,
    "json_schema": json_schema_value,
    "regex": regex_value,
    "ebnf": ebnf_value,
    "logit_bias": logit_bias_value,
    "sampling_seed": hostile(st.integers(-(2**63), 2**63 - 1), st.sampled_from(HUGE_INTS)),
    "custom_params": hostile(st.dictionaries(st.text(max_size=4), scalar_junk, max_size=2)),
    "stream_interval": hostile(st.integers(1, 4), st.sampled_from([0, -1, *HUGE_INTS])),
}
SAMPLING_KNOWN = {"max_new_tokens", *SAMPLING_FIELDS}


@st.composite
def sampling_params(draw: st.DrawFn) -> dict[str, Any]:
    # max_new_tokens is always given: the default (128) is too costly to fuzz with
    return draw(fill({"max_new_tokens": gen_len()}, SAMPLING_FIELDS, SAMPLING_KNOWN))


GENERATE_FIELDS: dict[str, Field] = {
    "stream": bool_value,
    "return_logprob": hostile(st.booleans(), st.lists(st.booleans(), max_size=3)),
    "logprob_start_len": hostile(st.integers(-1, 6), st.sampled_from([-2, 10**6, *HUGE_INTS])),
    "top_logprobs_num": hostile(st.integers(0, 5), st.sampled_from([-1, 10**6, VOCAB + 1, *HUGE_INTS])),
    "token_ids_logprob": token_ids,
    "return_text_in_logprobs": bool_value,
    "rid": rid_value,
    "priority": hostile(st.integers(-5, 5), st.sampled_from(HUGE_INTS)),
    "extra_key": hostile(short_text),
}
GENERATE_KNOWN = {"text", "input_ids", "sampling_params", *GENERATE_FIELDS}
TEXT = hostile(short_text, st.lists(short_text, max_size=3), st.just([]), st.lists(odd_text, min_size=1, max_size=2))
INPUT_IDS = hostile(
    st.lists(token_id, min_size=1, max_size=8) | st.lists(st.lists(token_id, min_size=1, max_size=4), min_size=1,
                                                           max_size=3),
    st.lists(bad_token_id, min_size=1, max_size=3),
    st.lists(st.lists(token_id, max_size=2), max_size=2),
)
# a batch of sampling params is one per prompt; each entry is bounded like a single one
SAMPLING = Field(
    sampling_params() | st.lists(sampling_params(), min_size=1, max_size=3),
    # not [] or null: the server reads them as the default length
    st.one_of(scalar_junk.filter(lambda v: v is not None), st.lists(scalar_junk, min_size=1, max_size=2)),
)


@st.composite
def generate_body(draw: st.DrawFn) -> dict[str, Any]:
    prompt = draw(st.sampled_from(["text", "input_ids", "both", "neither"]) if draw(st.integers(0, 9)) == 9
                  else st.sampled_from(["text", "input_ids"]))
    required = {"sampling_params": SAMPLING}
    if prompt in ("text", "both"):
        required["text"] = TEXT
    if prompt in ("input_ids", "both"):
        required["input_ids"] = INPUT_IDS
    return draw(fill(required, GENERATE_FIELDS, GENERATE_KNOWN))


# ---- OpenAI /v1/completions and /v1/chat/completions ---------------------------------------------
OPENAI_SAMPLING: dict[str, Field] = {
    "model": hostile(st.just(MODEL_ID), short_text),
    "temperature": number(0, 2),
    "top_p": number(0, 1),
    "n": small_n,
    "stop": stop_value,
    "seed": hostile(st.integers(0, 2**32), st.sampled_from(HUGE_INTS)),
    "stream": bool_value,
    "stream_options": hostile(st.fixed_dictionaries({"include_usage": st.booleans()}), unknown_keys(set())),
    "frequency_penalty": number(-2, 2),
    "presence_penalty": number(-2, 2),
    "logit_bias": logit_bias_value,
    "user": hostile(short_text),
    "top_k": hostile(st.integers(-1, 50), st.sampled_from([-2, *HUGE_INTS])),
    "min_p": number(0, 1),
    "repetition_penalty": number(0, 2),
    "min_tokens": hostile(st.integers(0, MAX_GEN), st.sampled_from([-1, 10**7, *HUGE_INTS])),
    "ignore_eos": bool_value,
    "stop_token_ids": token_ids,
    "skip_special_tokens": bool_value,
    "no_stop_trim": bool_value,
    "regex": regex_value,
    "ebnf": ebnf_value,
    "json_schema": json_schema_value,
}

COMPLETION_FIELDS: dict[str, Field] = {
    **OPENAI_SAMPLING,
    "logprobs": hostile(st.integers(0, 5), st.sampled_from([-1, 6, 21, 10**6, *HUGE_INTS])),
    "echo": bool_value,
    "suffix": hostile(short_text),
}
COMPLETION_KNOWN = {"prompt", "max_tokens", *COMPLETION_FIELDS}
PROMPT = hostile(
    short_text | st.lists(short_text, min_size=1, max_size=3) | st.lists(token_id, min_size=1, max_size=6)
    | st.lists(st.lists(token_id, min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(bad_token_id, min_size=1, max_size=3),
    st.just([]),
    st.lists(st.just([]), min_size=1, max_size=2),
)


def completion_body() -> st.SearchStrategy[dict[str, Any]]:
    return fill({"prompt": PROMPT, "max_tokens": gen_len()}, COMPLETION_FIELDS, COMPLETION_KNOWN)


ROLES = ["system", "developer", "user", "assistant", "tool"]
CONTENT = hostile(
    short_text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": short_text}), min_size=1,
                          max_size=2),
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["image_url", "audio", ""])}, optional={"text": junk}),
             min_size=1, max_size=2),
    st.none(),
)
TOOL_CALLS = hostile(
    st.lists(st.fixed_dictionaries({"id": st.just("c1"), "type": st.just("function"),
                                    "function": st.fixed_dictionaries({"name": st.just("get_weather"),
                                                                       "arguments": st.just('{"city": "Paris"}')})}),
             min_size=1, max_size=2),
    st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries({"arguments": junk.map(json.dumps)})}),
             min_size=1, max_size=1),
)
MESSAGE_FIELDS = {"name": hostile(short_text), "tool_calls": TOOL_CALLS, "tool_call_id": hostile(short_text)}
MESSAGE = {"role": hostile(st.sampled_from(ROLES), st.sampled_from(["", "bot", "USER"])), "content": CONTENT}
MESSAGES = hostile(
    st.lists(fill(MESSAGE, MESSAGE_FIELDS, {"role", "content", *MESSAGE_FIELDS}), min_size=1, max_size=3),
    st.just([]),
)
PARAMS_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = hostile(
    st.fixed_dictionaries(
        {"type": st.just("function"),
         "function": st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "f"])},
                                           optional={"description": short_text,
                                                     "parameters": st.sampled_from([PARAMS_SCHEMA, *BAD_SCHEMAS[:3]]),
                                                     "strict": st.booleans()})}
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["function", "code"]),
                           "function": st.fixed_dictionaries({"name": st.sampled_from(["", "a b", "💥"])})}),
)
RESPONSE_FORMAT = hostile(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})
    | st.fixed_dictionaries({"type": st.just("json_schema"),
                             "json_schema": st.fixed_dictionaries({"name": st.just("r")},
                                                                  optional={"schema": st.sampled_from(GOOD_SCHEMAS[:3]),
                                                                            "strict": st.booleans()})}),
    st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "xml", ""])}),
    st.fixed_dictionaries({"type": st.just("json_schema"),
                           "json_schema": st.fixed_dictionaries({"schema": st.sampled_from(BAD_SCHEMAS[:5])})}),
)
CHAT_FIELDS: dict[str, Field] = {
    **OPENAI_SAMPLING,
    "logprobs": bool_value,
    "top_logprobs": hostile(st.integers(0, 5), st.sampled_from([-1, 21, 10**6, *HUGE_INTS])),
    "response_format": RESPONSE_FORMAT,
    "tools": hostile(st.lists(TOOL.valid, max_size=2), st.lists(TOOL.bad, min_size=1, max_size=2)),
    "tool_choice": hostile(
        st.sampled_from(["none", "auto", "required"])
        | st.fixed_dictionaries({"type": st.just("function"),
                                 "function": st.fixed_dictionaries({"name": st.just("get_weather")})}),
        st.fixed_dictionaries({"type": st.just("function"),
                               "function": st.fixed_dictionaries({"name": st.sampled_from(["nope", ""])})}),
    ),
    "parallel_tool_calls": bool_value,
}
CHAT_KNOWN = {"messages", "max_tokens", "max_completion_tokens", *CHAT_FIELDS}


@st.composite
def chat_body(draw: st.DrawFn) -> dict[str, Any]:
    # one of the two lengths is always a bounded one: chat's default runs to the end of the context
    which = draw(st.sampled_from(["max_tokens", "max_completion_tokens", "both"]))
    required = {"messages": MESSAGES}
    if which in ("max_tokens", "both"):
        required["max_tokens"] = gen_len()
    if which in ("max_completion_tokens", "both"):
        required["max_completion_tokens"] = gen_len(allow_null=which == "both")
    return draw(fill(required, CHAT_FIELDS, CHAT_KNOWN))
