"""Device token automata: tables built from outlines-core DFAs step exactly as the host matcher
over the same DFA (masks, transitions, stop tokens), several grammars share one table, and the
routing rule keeps every schema the conversion would weaken on the host path."""

from __future__ import annotations

import gc
import json
import random

import numpy as np
import pytest
import torch
from phloem.grammars import create_backend
from phloem.grammars.automaton import FREE, AutomatonLaunch, AutomatonTable, build_automaton
from phloem.grammars.base import GrammarError, GrammarSpec
from phloem.grammars.bitmask import allocate_bitmask
from phloem.grammars.regular import runs_on_device

from .grammar_fake_model import STOP_TOKEN_IDS, VOCAB_SIZE, TokenClasses, _pick
from .test_json_schemas import SCHEMAS, UNSUPPORTED

WIDTH = VOCAB_SIZE + 64  # logits wider than the vocabulary, as in the other grammar tests
SPECS = {
    "regex": GrammarSpec("regex", r"\(\d{3}\) \d{3}-\d{4}( ext \d{1,4})?"),
    "nested": GrammarSpec("json_schema", json.dumps(SCHEMAS["nested_object"])),
    "enum_in_array": GrammarSpec("json_schema", json.dumps(SCHEMAS["enum_in_array"])),
}


@pytest.fixture(scope="module")
def backend(tokenizer):
    return create_backend(
        "outlines", tokenizer=tokenizer, vocab_size=WIDTH, stop_token_ids=STOP_TOKEN_IDS, build_automata=True
    )


@pytest.fixture(scope="module")
def classes(tokenizer):
    return TokenClasses.from_tokenizer(tokenizer, len(tokenizer))


def _host_mask(matcher) -> np.ndarray:
    mask = allocate_bitmask(1, WIDTH)
    matcher.fill_next_token_bitmask(mask, 0)
    return mask[0].numpy()


def _allowed(mask_row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:WIDTH])


@pytest.mark.parametrize("name", sorted(SPECS))
def test_device_steps_follow_the_host_matcher(backend, classes, name):
    """A walk of sampled tokens: before each token the device's mask row equals the matcher's,
    and after it the device's state is the matcher's (free once the stop token is taken)."""
    compiled = backend.compile(SPECS[name])
    table = AutomatonTable(WIDTH, num_rows=4, device="cpu")
    for seed in range(3):
        matcher = backend.new_matcher(compiled)
        entry = table.acquire(matcher.automaton)
        assert entry is not None
        rng = random.Random(seed)
        row = torch.tensor([2])
        init = torch.tensor([entry.global_state(matcher.automaton_state())])
        for _ in range(200):
            launch = AutomatonLaunch(table)
            states = launch.current(row, init)
            device_mask = table.snapshot.mask_rows(states)[0].numpy()
            np.testing.assert_array_equal(device_mask, _host_mask(matcher))
            token = _pick(rng, _allowed(device_mask), STOP_TOKEN_IDS, classes)
            launch.advance(row, states, torch.tensor([token]))
            assert matcher.accept_token(token)
            want = entry.global_state(matcher.automaton_state())
            assert int(table.state[2]) == want
            init = torch.tensor([-1])  # the next launch continues on the device
            if matcher.is_terminated():
                assert want == FREE
                break
        else:
            pytest.fail("the walk did not terminate")


def test_one_table_serves_several_grammars_and_free_rows(backend):
    table = AutomatonTable(WIDTH, num_rows=8, device="cpu")
    regex = backend.new_matcher(backend.compile(SPECS["regex"]))
    person = backend.new_matcher(backend.compile(SPECS["nested"]))
    a, b = table.acquire(regex.automaton), table.acquire(person.automaton)
    assert a is not None and b is not None
    assert (a.offset, b.offset) == (1, 1 + regex.automaton.num_states)
    assert table.acquire(regex.automaton).offset == a.offset  # registered once
    init = torch.tensor([a.global_state(regex.automaton_state()), FREE, b.global_state(person.automaton_state())])
    rows = torch.tensor([5, 0, 7])
    launch = AutomatonLaunch(table)
    states = launch.current(rows, init)
    masks = table.snapshot.mask_rows(states).numpy()
    np.testing.assert_array_equal(masks[0], _host_mask(regex))
    assert (masks[1] == -1).all()  # the free row allows every token
    np.testing.assert_array_equal(masks[2], _host_mask(person))
    paren, brace = _allowed(masks[0])[0], _allowed(masks[2])[0]
    launch.advance(rows, states, torch.tensor([paren, 12345, brace]))
    regex.accept_token(int(paren))
    person.accept_token(int(brace))
    assert table.state[[5, 0, 7]].tolist() == [
        a.global_state(regex.automaton_state()), FREE, b.global_state(person.automaton_state())
    ]


def test_a_grammar_that_does_not_fit_waits_for_the_table_to_empty(backend):
    regex = backend.compile(SPECS["regex"]).handle.automaton
    person = backend.compile(SPECS["nested"]).handle.automaton
    table = AutomatonTable(WIDTH, num_rows=2, device="cpu", max_states=1 + max(regex.num_states, person.num_states))
    held = table.acquire(regex)
    assert held is not None
    assert table.acquire(person) is None  # no room while a request uses the table
    del held
    gc.collect()
    entry = table.acquire(person)
    assert entry is not None and entry.offset == 1  # started over
    assert table.num_states == 1 + person.num_states


def test_the_state_limit_is_a_grammar_error(backend):
    index = backend.compile(SPECS["nested"]).handle.index
    with pytest.raises(GrammarError, match="states"):
        build_automaton(index, stop_token_ids=STOP_TOKEN_IDS, vocab_size=WIDTH, max_states=3)


def test_stop_tokens_leave_the_automaton_only_from_final_states(backend):
    auto = backend.compile(GrammarSpec("regex", "ab?")).handle.automaton
    for local in range(auto.num_states):
        for stop in STOP_TOKEN_IDS:
            allowed = bool(auto.masks[local, stop // 32] >> (stop % 32) & 1)
            assert allowed == (auto.next_local(local, stop) == -1)
    assert auto.next_local(auto.initial, STOP_TOKEN_IDS[0]) is None  # "" is not in the language


@pytest.mark.parametrize(
    ("spec", "device"),
    [
        (GrammarSpec("regex", "[a-z]+"), True),
        (GrammarSpec("json_schema", json.dumps(SCHEMAS["nested_object"])), True),
        (GrammarSpec("json_schema", json.dumps({"type": "integer", "minimum": 3})), False),
        (GrammarSpec("json_schema", json.dumps({"oneOf": [{"type": "string"}, {"type": "null"}]})), False),
        (GrammarSpec("json_schema", json.dumps({"type": "object", "additionalProperties": {"type": "string"}})), False),
        (GrammarSpec("json_schema", json.dumps({"type": "string", "format": "email"})), False),
        (GrammarSpec("json_schema", json.dumps({"type": "string", "format": "date"})), True),
        (GrammarSpec("json_schema", json.dumps({"type": "array", "items": [{"type": "string"}]})), False),
        (GrammarSpec("json_schema", json.dumps({"$ref": "#"})), False),
        (GrammarSpec("json_schema", "true"), False),
        (GrammarSpec("json_object"), False),
        (GrammarSpec("ebnf", 'root ::= "a"'), False),
    ],
)
def test_routing_rule(spec, device):
    assert runs_on_device(spec) is device


def test_only_acyclic_references_run_on_device():
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/b"}}}
    leaf = {"type": "object", "properties": {"v": {"type": "integer"}}}
    acyclic = {"$defs": {"a": node, "b": leaf}, "$ref": "#/$defs/a"}
    cyclic = {"$defs": {"a": node, "b": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}}, "$ref": "#/$defs/a"}
    assert runs_on_device(GrammarSpec("json_schema", json.dumps(acyclic)))
    assert not runs_on_device(GrammarSpec("json_schema", json.dumps(cyclic)))


def test_every_schema_the_conversion_weakens_stays_on_the_host():
    """The schemas outlines-core cannot honour are exactly what the rule must keep off the device;
    every schema the rule admits is one whose outlines outputs validate (test_json_schemas)."""
    for (backend_name, schema_name), _ in UNSUPPORTED.items():
        assert backend_name == "outlines"
        assert not runs_on_device(GrammarSpec("json_schema", json.dumps(SCHEMAS[schema_name]))), schema_name
    assert sum(runs_on_device(GrammarSpec("json_schema", json.dumps(s))) for s in SCHEMAS.values()) >= 5


@pytest.mark.parametrize(
    ("pattern", "ascii"),
    [
        (r"(19|20)\d\d", "(19|20)[0-9][0-9]"),
        (r"[\d\s]+", "[0-9 \\t\\n\\r\\f\\v]+"),
        (r"\D\W", "[^0-9][^0-9A-Za-z_]"),
        (r"[^\d]", "[^0-9]"),
        (r"\\d\.", r"\\d\."),  # an escaped backslash, then a literal d
        (r"[]\w]", "[]0-9A-Za-z_]"),
    ],
)
def test_shorthand_classes_are_spelled_ascii(pattern, ascii):
    from phloem.grammars.regular import ascii_shorthands

    assert ascii_shorthands(pattern) == ascii


def test_a_digit_means_an_ascii_digit_on_the_device(backend, tokenizer):
    """outlines-core alone would let ``\\d`` take any Unicode decimal digit (U+1D7E5 and the like);
    the device automaton allows only 0-9, as the other backends do."""
    auto = backend.compile(GrammarSpec("regex", r"\d{4}")).handle.automaton
    allowed = _allowed(auto.masks[auto.initial])
    texts = tokenizer.convert_ids_to_tokens([int(t) for t in allowed if t < len(tokenizer)])
    assert texts and all(all(c in "0123456789" for c in t) for t in texts), texts[:10]


def _prefix_by_hand(grammar, state: int) -> tuple[bytes, int | None]:
    """The common byte prefix of every allowed token, spelled out token by token (the oracle)."""
    stops = set(grammar.stop_token_ids)
    allowed = [t for t in grammar.index.get_allowed_tokens(state) or [] if t not in stops]
    spellings = {t: grammar.token_bytes[t] or b"" for t in allowed}
    if not spellings:
        return b"", None
    lo, hi = min(spellings.values()), max(spellings.values())
    size = next((i for i, (a, b) in enumerate(zip(lo, hi)) if a != b), min(len(lo), len(hi)))
    prefix = lo[:size]
    exact = [t for t, s in spellings.items() if s == prefix] if prefix else []
    return prefix, (exact[0] if exact else None)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_jump_forward_prefixes_match_the_token_by_token_answer(tokenizer, backend, classes, name):
    """The cached prefix of a state (read from the automaton's keys, first bytes compared at once)
    is the one a loop over every allowed token finds, on walks through the grammar, with and
    without the automaton built."""
    plain = create_backend("outlines", tokenizer=tokenizer, vocab_size=WIDTH, stop_token_ids=STOP_TOKEN_IDS)
    for b in (backend, plain):
        matcher = b.new_matcher(b.compile(SPECS[name]))
        grammar = matcher._grammar
        rng = random.Random(0)
        for _ in range(200):
            state = matcher._states[-1]
            want = _prefix_by_hand(grammar, state)
            got = grammar.common_prefix(state)
            assert got[0] == want[0] and (got[1] is None) == (want[1] is None)
            if got[1] is not None:
                assert grammar.token_bytes[got[1]] == got[0]
            token = _pick(rng, _allowed(_host_mask(matcher)), STOP_TOKEN_IDS, classes)
            assert matcher.accept_token(token)
            if matcher.is_terminated():
                break


KEYS = GrammarSpec("json_schema", json.dumps({
    "type": "object", "additionalProperties": False,
    "properties": {"customer_identification_code": {"type": "string", "maxLength": 4}, "is_active": {"type": "boolean"}},
    "required": ["customer_identification_code", "is_active"],
}))  # fmt: skip


def test_forcing_narrows_masks_to_one_token_and_keeps_the_transitions(backend):
    automaton = backend.new_matcher(backend.compile(SPECS["regex"])).automaton
    allowed = np.unpackbits(automaton.masks[automaton.initial].view(np.uint8), bitorder="little")
    token = int(np.flatnonzero(allowed)[-1])
    forced = np.full(automaton.num_states, -1, dtype=np.int32)
    forced[automaton.initial] = token
    narrowed = automaton.forcing(forced)
    bits = np.unpackbits(narrowed.masks[automaton.initial].view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [token]
    others = np.arange(automaton.num_states) != automaton.initial
    assert np.array_equal(narrowed.masks[others], automaton.masks[others])
    assert narrowed.keys is automaton.keys and narrowed.targets is automaton.targets
    forced[automaton.initial] = next(t for t in range(VOCAB_SIZE) if not allowed[t])
    with pytest.raises(ValueError, match="not allowed"):
        automaton.forcing(forced)


def test_device_spelling_takes_the_tokenizers_own_encoding_of_forced_text(tokenizer):
    """With ``canonical_forced_text`` every state forcing text of two tokens or more allows only
    the first token of its encoding; a walk that takes those tokens spells each forced key as the
    tokenizer would, and the host matcher (the same DFA) accepts every one."""
    spelled = create_backend("outlines", tokenizer=tokenizer, vocab_size=WIDTH, stop_token_ids=STOP_TOKEN_IDS,
                             build_automata=True, canonical_forced_text=True)  # fmt: skip
    matcher = spelled.new_matcher(spelled.compile(KEYS))
    automaton = matcher.automaton
    assert automaton.forced is not None and (automaton.forced >= 0).any()
    for token in tokenizer.encode('{"', add_special_tokens=False):  # whitespace may follow "{"
        assert matcher.accept_token(token)
    start = matcher.find_jump_forward_string()
    assert start.startswith('customer_identification_code"')
    first = tokenizer.encode(start, add_special_tokens=False)[0]
    assert automaton.forced[matcher.automaton_state()] == first
    out: list[int] = []
    for _ in range(40):
        state = matcher.automaton_state()
        if automaton.forced[state] < 0:
            break
        token = int(automaton.forced[state])
        bits = np.unpackbits(automaton.masks[state].view(np.uint8), bitorder="little")
        assert np.flatnonzero(bits).tolist() == [token]
        assert matcher.accept_token(token)
        out.append(token)
    text = tokenizer.decode(out)
    assert text and start.startswith(text)
    assert out == tokenizer.encode(text, add_special_tokens=False)  # the canonical spelling


def _state_graph(auto) -> tuple[dict[int, set[int]], set[int]]:
    """Each state's successor states, and the states that allow a stop token."""
    edges: dict[int, set[int]] = {}
    stops = set()
    for key, target in zip(auto.keys.tolist(), auto.targets.tolist()):
        src = key // auto.vocab_size
        if target < 0:
            stops.add(src)
        else:
            edges.setdefault(src, set()).add(target)
    return edges, stops


def _steps_to_stop_by_hand(auto) -> list[int]:
    """From each state on its own, a forward breadth-first walk to the first state that allows a
    stop token (the stop token counts as one step)."""
    edges, stops = _state_graph(auto)
    out = []
    for start in range(auto.num_states):
        seen, frontier, steps = {start}, [start], 1
        while frontier and not any(s in stops for s in frontier):
            frontier = [t for s in frontier for t in edges.get(s, ()) if t not in seen]
            seen.update(frontier)
            steps += 1
        out.append(steps if frontier else -1)
    return out


@pytest.mark.parametrize("name", ["regex", "nested"])
def test_steps_to_stop_is_the_shortest_way_to_the_end(backend, name):
    from phloem.grammars.automaton import UNREACHABLE

    auto = backend.compile(SPECS[name]).handle.automaton
    got = [int(d) if d != UNREACHABLE else -1 for d in auto.steps_to_stop]
    assert got == _steps_to_stop_by_hand(auto)
    assert got[auto.initial] > 1 and min(got) == 1


def _longest_to_stop_by_hand(auto) -> list[int]:
    """From each state, a depth-first walk over every way on: the most steps to a stop token (the
    stop counts as one), or -1 where a walk comes back to a state it is on (a loop)."""
    edges, stops = _state_graph(auto)
    memo: dict[int, int] = {}

    def longest(s: int, path: frozenset[int]) -> int:
        if s in path:
            return -1
        if s not in memo:
            ways = [longest(t, path | {s}) for t in edges.get(s, ())]
            if any(w < 0 for w in ways):
                memo[s] = -1
            else:
                memo[s] = max(([1] if s in stops else []) + [w + 1 for w in ways])
        return memo[s]

    return [longest(s, frozenset()) for s in range(auto.num_states)]


@pytest.mark.parametrize("name", ["regex", "nested", "enum_in_array"])
def test_longest_to_stop_is_the_longest_way_to_the_end(backend, name):
    from phloem.grammars.automaton import UNBOUNDED

    auto = backend.compile(SPECS[name]).handle.automaton
    got = [int(d) if d != UNBOUNDED else -1 for d in auto.longest_to_stop]
    assert got == _longest_to_stop_by_hand(auto)
    bounded = [g for g in got if g > 0]
    assert bounded and min(bounded) == 1
    assert all(g == -1 or g >= s for g, s in zip(got, auto.steps_to_stop.tolist()))


def test_a_loop_ahead_leaves_a_state_unbounded(backend):
    from phloem.grammars.automaton import UNBOUNDED

    auto = backend.compile(GrammarSpec("regex", r"[a-z]+!")).handle.automaton
    assert auto.longest_to_stop[auto.initial] == UNBOUNDED
    assert auto.longest_to_stop.min() == 1  # after the "!": only the stop token is left
