"""Model-free generation: sample under the mask for many schemas and validate what comes out."""

from __future__ import annotations

import json

import jsonschema
import pytest
from phloem.grammars import GrammarSpec

from .grammar_fake_model import STOP_TOKEN_IDS, TokenClasses, sample_output

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

# name -> schema. Every schema is closed (additionalProperties false or no object at all) so the
# backends agree on which keys may appear.
SCHEMAS: dict[str, dict] = {
    "integer": {"type": "integer"},
    "boolean": {"type": "boolean"},
    "null": {"type": "null"},
    "short_string": {"type": "string", "maxLength": 8},
    "string_min_max": {"type": "string", "minLength": 2, "maxLength": 5},
    "string_pattern": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
    "format_date": {"type": "string", "format": "date"},
    "format_uuid": {"type": "string", "format": "uuid"},
    "format_email": {"type": "string", "format": "email"},
    "enum_strings": {"enum": ["red", "green", "blue"]},
    "enum_mixed": {"enum": ["a", 1, None, True]},
    "const": {"const": "fixed"},
    "int_bounds": {"type": "integer", "minimum": -5, "maximum": 120},
    "int_exclusive": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    "number": {"type": "number"},
    "number_bounds": {"type": "number", "minimum": 0, "maximum": 1},
    "flat_object": PERSON,
    "optional_keys": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
        "additionalProperties": False,
    },
    "nested_object": {
        "type": "object",
        "properties": {
            "person": PERSON,
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        },
        "required": ["person", "tags"],
        "additionalProperties": False,
    },
    "array_min_max": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "array_of_objects": {"type": "array", "items": PERSON, "maxItems": 2},
    "tuple_prefix_items": {
        "type": "array",
        "prefixItems": [{"type": "string", "maxLength": 4}, {"type": "integer"}],
        "items": False,
    },
    "any_of": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]},
    "one_of_objects": {
        "oneOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "a"}},
                "required": ["kind"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
                "additionalProperties": False,
            },
        ]
    },
    "defs_ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "recursive_ref": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                },
                "required": ["v", "next"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "nullable_type_list": {"type": ["string", "null"], "maxLength": 6},
    "enum_in_array": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3},
}

# (backend, schema) pairs a backend truly cannot honour, with the reason.
UNSUPPORTED: dict[tuple[str, str], str] = {
    (
        "outlines",
        "format_email",
    ): "outlines-core's email regex allows a quoted local part with bare quotes (invalid JSON)",
    ("outlines", "int_bounds"): "outlines-core's schema-to-regex ignores minimum/maximum",
    (
        "outlines",
        "int_exclusive",
    ): "outlines-core's schema-to-regex ignores exclusiveMinimum/exclusiveMaximum",
    ("outlines", "number_bounds"): "outlines-core's schema-to-regex ignores bounds on non-integer numbers",
}

SEEDS = (0, 1)


@pytest.fixture(scope="module")
def classes(tokenizer):
    return TokenClasses.from_tokenizer(tokenizer, len(tokenizer))


@pytest.mark.parametrize("schema_name", sorted(SCHEMAS))
def test_sampled_outputs_validate(backend, schema_name, tokenizer, classes):
    if (backend.name, schema_name) in UNSUPPORTED:
        pytest.skip(UNSUPPORTED[backend.name, schema_name])
    schema = SCHEMAS[schema_name]
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(schema)))
    finished = 0
    for seed in SEEDS:
        matcher = backend.new_matcher(compiled)
        ids, terminated = sample_output(
            matcher, vocab_size=backend.vocab_size, stop_token_ids=STOP_TOKEN_IDS, classes=classes, seed=seed
        )
        if terminated:
            finished += 1
            text = tokenizer.decode(ids)
            jsonschema.validate(json.loads(text), schema)
    assert finished, f"no sample of {schema_name} terminated within the token cap"
