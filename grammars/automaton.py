"""Token automata on the device: a regular grammar as tensors, so a constrained row masks and
advances on the GPU and the host need not see a token before the next one is sampled.

A regex, or a JSON schema without recursion, is a token-level DFA (outlines-core's ``Index``).
:class:`TokenAutomaton` holds one DFA as host arrays, with dense local state ids:

- ``masks[s]``: the int32 bitmask row of the tokens state ``s`` allows (stop tokens where ``s``
  may end; the layout of :mod:`phloem.grammars.bitmask`);
- ``keys`` / ``targets``: every transition ``(s, token) -> s'`` as the sorted key ``s * V + token``
  and its target, ``-1`` after a stop token.

:class:`AutomatonTable` keeps the automata in use on the device as one state space: state 0 is
*free* (every token allowed, every token leads back to it, the state of an unconstrained row), and
automaton ``a`` occupies ``[offset_a, offset_a + S_a)``. One gather gives a batch's mask rows
and one ``searchsorted`` its next states, whatever mix of grammars the batch holds. Each request
row of the scheduler's request pool keeps its current state in ``state[row]`` on the device.

The table only grows while a row may still read it (offsets never move under a live request);
it starts over once no request uses it. Lookups go through an immutable snapshot, so a step in
flight keeps reading the tables it was launched with.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch

from .base import GrammarError

FREE = 0  # the state of an unconstrained row: all tokens allowed, self loop
UNREACHABLE = np.iinfo(np.int32).max  # steps_to_stop of a state with no path to a stop
UNBOUNDED = UNREACHABLE  # longest_to_stop of a state from which a loop is reachable (same sentinel)
MAX_STATES = 4096  # states of one automaton; a larger DFA stays on the host path
MAX_TRANSITIONS = 8_000_000  # transitions of one automaton (12 bytes each on the device)


@dataclass(frozen=True)
class TokenAutomaton:
    """One token DFA as host arrays (see the module docstring); immutable once built."""

    state_ids: np.ndarray  # [S] int64, sorted: the DFA's own state ids, local id = position
    masks: np.ndarray  # [S, W] int32
    keys: np.ndarray  # [T] int64, sorted: local_state * vocab_size + token
    targets: np.ndarray  # [T] int32: local next state, -1 after a stop token
    initial: int  # local id of the start state
    vocab_size: int
    # [S] int32 or None: the one token the mask allows in each state that forces text (-1: the
    # state's own mask), set by ``forcing`` (jump-forward's canonical spelling, on the device)
    forced: np.ndarray | None = None

    @property
    def num_states(self) -> int:
        return int(self.state_ids.shape[0])

    def local(self, state_id: int) -> int:
        """Local id of one of the DFA's own state ids."""
        i = int(np.searchsorted(self.state_ids, state_id))
        if i >= self.num_states or int(self.state_ids[i]) != state_id:
            raise KeyError(f"state {state_id} is not a state of this automaton")
        return i

    def forcing(self, forced: np.ndarray) -> TokenAutomaton:
        """A copy whose mask in each state ``s`` with ``forced[s] >= 0`` allows that token alone.
        Each forced token must be one of the state's transitions (so the DFA, the host matcher
        and every other table stay as they are: only the choice among valid tokens narrows)."""
        forced = np.asarray(forced, dtype=np.int32)
        if forced.shape != (self.num_states,):
            raise ValueError(f"forced has shape {forced.shape}, the automaton {self.num_states} states")
        states = np.flatnonzero(forced >= 0)
        tokens = forced[states].astype(np.int64)
        for s, t in zip(states.tolist(), tokens.tolist()):
            if self.next_local(s, t) is None:
                raise ValueError(f"token {t} is not allowed in state {s}")
        masks = self.masks.copy()
        masks[states] = 0
        bits = np.left_shift(np.int64(1), tokens % 32).astype(np.uint32).view(np.int32)
        masks[states, tokens // 32] = bits
        return dataclasses.replace(self, masks=masks, forced=forced)

    @functools.cached_property
    def chain(self) -> np.ndarray:
        """``[S]`` int32: the one token each state's mask allows, where it allows exactly one
        and that token continues the text (a stop token never does); -1 elsewhere. Decoding
        such a state gives that token whatever the logits say, so a chain decode launch takes it
        without sampling (``runtime/executor/chain_decode.py``)."""
        src = self.keys // self.vocab_size
        out = np.full(self.num_states, -1, dtype=np.int32)
        alone = np.bincount(src, minlength=self.num_states) == 1
        first = np.searchsorted(src, np.arange(self.num_states))  # each state's first transition
        one = np.flatnonzero(alone)
        go = self.targets[first[one]] >= 0
        out[one[go]] = (self.keys[first[one[go]]] % self.vocab_size).astype(np.int32)
        if self.forced is not None:  # the mask of a forcing state allows its forced token alone
            out = np.where(self.forced >= 0, self.forced, out).astype(np.int32)
        return out

    @functools.cached_property
    def steps_to_stop(self) -> np.ndarray:
        """``[S]`` int32: the fewest tokens from each state to the end, the stop token included
        (1 in a state that may stop; ``UNREACHABLE`` where no path ends). A lower bound on what
        a row in that state still generates: the scheduler waits for a launch, instead of
        queueing the next one behind it, when every row may end inside it."""
        n = self.num_states
        src = self.keys // self.vocab_size
        ends = self.targets < 0
        dist = np.full(n, UNREACHABLE, dtype=np.int32)
        dist[np.unique(src[ends])] = 1
        # the state graph's distinct edges, walked backwards one level at a time
        pairs = np.unique(src[~ends] * n + self.targets[~ends])
        edge_src, edge_dst = pairs // n, pairs % n
        frontier = dist == 1
        level = 1
        while frontier.any():
            level += 1
            reached = np.unique(edge_src[frontier[edge_dst]])
            reached = reached[dist[reached] == UNREACHABLE]
            dist[reached] = level
            frontier = np.zeros(n, dtype=bool)
            frontier[reached] = True
        return dist

    @functools.cached_property
    def longest_to_stop(self) -> np.ndarray:
        """``[S]`` int32: the most tokens from each state to the end, the stop token included
        (``UNBOUNDED`` where a loop is reachable). An upper bound on what a row in that state
        still generates: past it the row has certainly stopped, so the scheduler launches no
        more steps for it (as it does at ``max_new_tokens``). A state's bound is known once every
        state it leads to has one, so states are settled from the ends backwards, a level at a
        time; those never settled reach a loop."""
        n = self.num_states
        src = self.keys // self.vocab_size
        ends = self.targets < 0
        longest = np.full(n, UNBOUNDED, dtype=np.int32)
        best = np.zeros(n, dtype=np.int64)  # the longest settled way on, 1 where it may stop here
        best[np.unique(src[ends])] = 1
        pairs = np.unique(src[~ends] * n + self.targets[~ends])
        edge_src, edge_dst = pairs // n, pairs % n
        waiting = np.bincount(edge_src, minlength=n)  # successors not settled yet
        waiting[(waiting == 0) & (best == 0)] = 1  # a dead end (no token allowed) bounds nothing
        frontier = waiting == 0
        while frontier.any():
            longest[frontier] = best[frontier]
            done = frontier[edge_dst]
            np.maximum.at(best, edge_src[done], best[edge_dst[done]] + 1)
            before = waiting > 0
            np.subtract.at(waiting, edge_src[done], 1)
            frontier = before & (waiting == 0)
        return longest

    def next_local(self, state: int, token: int) -> int | None:
        """The local state after ``token`` (-1 after a stop token), None when it is not allowed;
        the host-side meaning of one device step."""
        key = state * self.vocab_size + token
        i = int(np.searchsorted(self.keys, key))
        if i < self.keys.shape[0] and int(self.keys[i]) == key:
            return int(self.targets[i])
        return None


def build_automaton(
    index: Any,
    *,
    stop_token_ids: Sequence[int],
    vocab_size: int,
    max_states: int = MAX_STATES,
    max_transitions: int = MAX_TRANSITIONS,
) -> TokenAutomaton:
    """The :class:`TokenAutomaton` of an outlines-core ``Index``.

    Stop tokens are taken out of the DFA's own transitions and allowed exactly in its final
    states, leading out of the automaton (-1). Raises :class:`GrammarError` when the DFA is
    larger than ``max_states`` or ``max_transitions``.
    """
    transitions: dict[int, dict[int, int]] = index.get_transitions()
    finals = np.array(sorted(index.get_final_states()), dtype=np.int64)
    count = sum(len(row) for row in transitions.values())
    if count > max_transitions:
        raise GrammarError(f"the grammar's automaton has {count} transitions; the limit is {max_transitions}")
    # every transition as three flat arrays, in one pass over the DFA's dictionaries
    src = np.repeat(np.fromiter(transitions.keys(), np.int64, len(transitions)),
                    np.fromiter(map(len, transitions.values()), np.int64, len(transitions)))  # fmt: skip
    tok = np.fromiter(chain.from_iterable(transitions.values()), np.int64, count)
    dst = np.fromiter(chain.from_iterable(row.values() for row in transitions.values()), np.int64, count)
    sources = np.fromiter(transitions.keys(), np.int64, len(transitions))
    state_ids = _unique(np.concatenate([sources, _unique(dst), finals, [index.get_initial_state()]]))
    if len(state_ids) > max_states:
        raise GrammarError(f"the grammar's automaton has {len(state_ids)} states; the limit is {max_states}")
    stops = np.array(sorted(set(stop_token_ids)), dtype=np.int64)
    keep = (tok < vocab_size) & ~np.isin(tok, stops)
    local_src = np.searchsorted(state_ids, src[keep])
    local_dst = np.searchsorted(state_ids, dst[keep]).astype(np.int32)
    tok = tok[keep]
    # stop tokens: allowed exactly in final states, leading out of the automaton
    final_local = np.searchsorted(state_ids, finals)
    local_src = np.concatenate([local_src, np.repeat(final_local, len(stops))])
    tok = np.concatenate([tok, np.tile(stops, len(final_local))])
    local_dst = np.concatenate([local_dst, np.full(len(final_local) * len(stops), -1, dtype=np.int32)])
    keys = local_src * vocab_size + tok
    order = np.argsort(keys, kind="stable")
    words = (vocab_size + 31) // 32
    masks = np.zeros(len(state_ids) * words, dtype=np.int64)
    np.bitwise_or.at(masks, local_src * words + tok // 32, np.left_shift(1, tok % 32))
    return TokenAutomaton(
        state_ids=state_ids,
        masks=masks.astype(np.uint32).view(np.int32).reshape(len(state_ids), words),
        keys=keys[order],
        targets=local_dst[order],
        initial=int(np.searchsorted(state_ids, index.get_initial_state())),
        vocab_size=vocab_size,
    )


def _unique(ids: np.ndarray) -> np.ndarray:
    """Sorted distinct non-negative ids; by counting when they are small (DFA state ids are)."""
    if ids.size and int(ids.max()) < 1 << 26:
        return np.flatnonzero(np.bincount(ids))
    return np.unique(ids)


@dataclass(frozen=True)
class TableSnapshot:
    """The device tables at one moment: what a launched step reads, whatever is added later."""

    masks: torch.Tensor  # [1 + sum S, W] int32; row 0 (free) allows everything
    keys: torch.Tensor  # [sum T + 1] int64, sorted, ending with a sentinel larger than any key
    targets: torch.Tensor  # [sum T + 1] int32 global next state (FREE after a stop token)
    vocab_size: int
    chain: torch.Tensor  # [1 + sum S] int32 the one token a state allows (TokenAutomaton.chain), or -1

    def mask_rows(self, states: torch.Tensor) -> torch.Tensor:
        """Bitmask rows ``[B, W]`` of global states ``[B]``."""
        return self.masks[states]

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Global states after ``tokens``: the free state stays free, a stop token (or, were the
        mask ever bypassed, a token with no transition) leads to the free state. The host's
        matcher checks every token, so the latter cannot pass unnoticed."""
        key = states.to(torch.int64) * self.vocab_size + tokens.to(torch.int64)
        i = torch.searchsorted(self.keys, key)  # in range: the sentinel is larger than any key
        hit = self.keys[i] == key
        nxt = torch.where(hit, self.targets[i], torch.zeros_like(self.targets[i]))
        return torch.where(states == FREE, torch.zeros_like(nxt), nxt)


@dataclass(frozen=True, eq=False)
class AutomatonEntry:
    """One request's use of a registered automaton: where its states start in the table. The
    table counts a use for as long as the entry is alive (the request holds it)."""

    automaton: TokenAutomaton
    offset: int

    def global_state(self, local: int) -> int:
        """The table state of local state ``local`` (-1, past a stop token, is the free state)."""
        return FREE if local < 0 else self.offset + local


class AutomatonTable:
    """The device's automata and every request row's current state (see the module docstring).

    Used from the scheduler thread (``acquire``); launched steps read ``snapshot`` and ``state`` on
    the forward thread, in launch order.

    Parameters
    ----------
    vocab_size : int
        Width of the logits.
    num_rows : int
        Rows of the request pool (``state`` is indexed by a request's row).
    device : torch.device | str
        Where the tables live.
    max_states : int
        Total states the table holds; a grammar that does not fit while others are in use takes
        the host path.
    """

    def __init__(self, vocab_size: int, num_rows: int, device: torch.device | str, *, max_states: int = 16384) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.max_states = max_states
        self.state = torch.zeros(num_rows, dtype=torch.int32, device=self.device)
        self._offsets: dict[int, int] = {}  # id(automaton) -> first state
        self._uses: weakref.WeakSet[AutomatonEntry] = weakref.WeakSet()
        self._host: list[TokenAutomaton] = []
        self.snapshot = self._upload()

    @property
    def num_states(self) -> int:
        return 1 + sum(a.num_states for a in self._host)

    @property
    def in_use(self) -> bool:
        """Whether any live request holds an entry (else no launch has a row on the device)."""
        return len(self._uses) > 0

    def acquire(self, automaton: TokenAutomaton) -> AutomatonEntry | None:
        """The entry of ``automaton`` for a new request (registering it if needed), or None when
        it does not fit while other requests use the table."""
        offset = self._offsets.get(id(automaton))
        if offset is None:
            if self.num_states + automaton.num_states > self.max_states:
                if self.in_use:
                    return None
                self._offsets.clear()  # nobody reads the table: start it over
                self._host.clear()
                if 1 + automaton.num_states > self.max_states:
                    return None
            offset = self._offsets[id(automaton)] = self.num_states
            self._host.append(automaton)  # keeps id(automaton) from being reused
            self.snapshot = self._upload()
        entry = AutomatonEntry(automaton, offset)
        self._uses.add(entry)
        return entry

    def _upload(self) -> TableSnapshot:
        words = (self.vocab_size + 31) // 32
        masks = [np.full((1, words), -1, dtype=np.int32)]
        keys, targets, chains = [], [], [np.full(1, -1, dtype=np.int32)]
        offset = 1
        for a in self._host:
            masks.append(a.masks)
            keys.append(a.keys + offset * self.vocab_size)
            targets.append(np.where(a.targets < 0, FREE, a.targets + offset).astype(np.int32))
            chains.append(a.chain)
            offset += a.num_states
        keys.append(np.array([np.iinfo(np.int64).max], dtype=np.int64))
        targets.append(np.zeros(1, dtype=np.int32))
        snap = TableSnapshot(
            masks=torch.from_numpy(np.concatenate(masks)).to(self.device),
            keys=torch.from_numpy(np.concatenate(keys)).to(self.device),
            targets=torch.from_numpy(np.concatenate(targets)).to(self.device),
            vocab_size=self.vocab_size,
            chain=torch.from_numpy(np.concatenate(chains)).to(self.device),
        )
        if self.device.type == "cuda":  # steps on the forward thread's stream read these next
            torch.cuda.synchronize(self.device)
        return snap


class AutomatonLaunch:
    """The automaton part of one launch, shared by every step of it: the table snapshot it was
    launched with, and whether the rows' starting states are applied yet.

    A launch's rows are request-pool rows ``rows [B]`` (int64) with ``init [B]`` (int64): the
    state a row starts from when the host knows it (``>= 0``), or -1 to continue from the device's
    ``state[row]`` (the row's previous launch is still in flight). Both travel with the launch's
    sampling tensors (``SamplingInfo.automaton_rows`` / ``automaton_init``)."""

    def __init__(self, table: AutomatonTable, *, has_init: bool = True) -> None:
        self.table = table
        self.snapshot = table.snapshot
        # False when every row continues on the device (the overlap loop's steady state): the
        # starting states then need no write at all
        self._started = not has_init

    def start(self, rows: torch.Tensor, init: torch.Tensor) -> None:
        """Apply ``init`` (the first call of the launch; later calls do nothing)."""
        if self._started:
            return
        state = self.table.state
        state[rows] = torch.where(init >= 0, init.to(state.dtype), state[rows])
        self._started = True

    def current(self, rows: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
        """Every row's state ``[B]`` on the device."""
        self.start(rows, init)
        return self.table.state[rows]

    def advance(self, rows: torch.Tensor, states: torch.Tensor, tokens: torch.Tensor) -> None:
        """Store every row's state after its sampled token."""
        self.table.state[rows] = self.snapshot.advance(states, tokens)
