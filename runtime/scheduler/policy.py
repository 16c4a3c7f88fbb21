"""Waiting-queue order, sibling deferral, retraction order and the new-token ratio (docs/design.md §4).

Everything here is a pure function of requests and numbers, so each rule has a unit test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from phloem.runtime.forward_io import StepTime
from phloem.runtime.scheduler.req import Req

LPM_FALLBACK_QUEUE_LEN = 128
SIBLING_MIN_SHARED = 32
RETRACT_DECODE_STEPS = 20


def order_waiting(
    waiting: list[Req],
    *,
    policy: str,
    prefix_len_of: Callable[[Req], int],
    use_priority: bool,
) -> list[Req]:
    """Return the waiting requests in admission order.

    ``fcfs``: arrival order. ``lpm``: longest cached prefix first (``prefix_len_of`` matches the
    tree), falling back to fcfs when more than 128 wait since matching them all costs more than it
    saves. With priorities, higher ``priority`` goes first and the policy orders within a level.
    """
    reqs = list(waiting)
    if policy == "lpm" and len(reqs) <= LPM_FALLBACK_QUEUE_LEN:
        lens = {id(r): prefix_len_of(r) for r in reqs}
        reqs.sort(key=lambda r: (-lens[id(r)], r.arrival_time))
    else:
        reqs.sort(key=lambda r: r.arrival_time)
    if use_priority:
        reqs.sort(key=lambda r: -r.priority)  # stable: keeps the policy order inside a level
    return reqs


def common_prefix_len(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


def should_defer_sibling(req: Req, admitted: Sequence[Req]) -> bool:
    """True when ``req`` shares an uncached prefix of 32+ tokens with one of ``admitted``: requests
    admitted in this round (a continued chunk included) or whose prompt is still being computed.
    ``req`` waits until that prompt is in the tree and reads the shared part from it instead of
    computing it twice (n > 1, fork children, a batch with a common stem).

    Only meaningful with a radix tree: without one nothing is ever read back, so waiting would only
    delay ``req`` (the scheduler does not ask then)."""
    ids = req.fill_ids
    for other in admitted:
        shared = common_prefix_len(ids, other.fill_ids, start=req.prefix_len)
        if shared - req.prefix_len >= SIBLING_MIN_SHARED:
            return True
    return False


def retraction_order(running: Sequence[Req]) -> list[Req]:
    """Requests in the order they are retracted: least output first, then longer input (it has
    the most KV to give back and its prompt is likely to stay in the tree)."""
    return sorted(running, key=lambda r: (len(r.output_ids), -r.prompt_len))


def ratio_after_retraction(remaining: Sequence[Req]) -> float:
    """New-token ratio after a retraction: what the survivors have decoded plus a 20-step
    headroom each, over their total ``max_new_tokens``, capped at 1.0."""
    decoded = sum(len(r.output_ids) for r in remaining)
    total_max = sum(r.params.max_new_tokens for r in remaining)
    if total_max <= 0:
        return 1.0
    return min(1.0, (decoded + RETRACT_DECODE_STEPS * len(remaining)) / total_max)


class NewTokenRatio:
    """The forecast ratio: starts at 0.7 x conservativeness, decays linearly each decode step to a
    floor reached after about 600 steps, jumps up after a retraction."""

    DECAY_STEPS = 600

    def __init__(self, conservativeness: float = 1.0) -> None:
        self.init = min(0.7 * conservativeness, 1.0)
        self.floor = self.init * 0.2
        self.decay = (self.init - self.floor) / self.DECAY_STEPS
        self.value = self.init

    def step(self) -> None:
        self.value = max(self.value - self.decay, self.floor)

    def reset(self) -> None:
        self.value = self.init

    def raise_to(self, value: float) -> None:
        self.value = max(self.value, min(value, 1.0))


def needs_host_mask(req: Req) -> bool:
    """A constrained row whose mask the host fills (its grammar is not on the device)."""
    return req.grammar is not None and req.automaton is None


def decodes_ahead(req: Req) -> bool:
    """Whether a request may take several decode steps before the host sees their tokens
    (continuous decode): nothing about its next token may depend on the host reading the one
    before. Logprobs are read per step; a grammar's host mask follows every token (a grammar on
    the device masks and advances there); penalties count
    output tokens on the host; a seeded stream is positioned per step; and the min_new_tokens
    ban lifts at a step the host must see."""
    p = req.params
    return not (
        req.return_logprob
        or needs_host_mask(req)
        or p.frequency_penalty
        or p.presence_penalty
        or p.repetition_penalty != 1.0
        or p.sampling_seed is not None
        or req.num_outputs_launched < p.min_new_tokens
    )


def device_stop_ids(req: Req, grammar_stops: Iterable[int] = ()) -> frozenset[int]:
    """Token ids whose sampling in the request's next launch certainly ends it on the host, for
    early exit of continuous decode (``executor/decode_exit.py``): its stop token ids (EOS unless
    ``ignore_eos``), which end a request once ``min_new_tokens`` are out, and under a grammar the
    grammar's stop tokens (``grammar_stops``), which end it too: accepted, they terminate the
    grammar; refused, they abort the request. Empty, so the batch never skips a step for this
    row, while a ``min_new_tokens`` floor could hold a stop back (a jump-forward can rewrite the
    output's tail, so under a grammar any floor counts)."""
    floor = req.params.min_new_tokens
    if floor and (req.grammar is not None or len(req.output_ids) < floor):
        return frozenset()
    if req.grammar is not None:
        return req.stop_checker.stop_token_ids | frozenset(grammar_stops)
    return req.stop_checker.stop_token_ids


def stop_rows(reqs: Sequence[Req], grammar_stops: Iterable[int] = ()) -> tuple[list[list[int]], list[int]]:
    """Per row, its :func:`device_stop_ids` padded with -1 to the batch's widest (at least one
    column), and its ``stop_tag``."""
    ids = [sorted(device_stop_ids(r, grammar_stops)) for r in reqs]
    width = max(1, max(map(len, ids), default=0))
    return [row + [-1] * (width - len(row)) for row in ids], [r.stop_tag for r in reqs]


AUTO_DECODE_STEPS = 8  # the most steps one launch carries when --num-continuous-decode-steps is auto
AUTO_DECODE_BUDGET_MS = 8.0  # device time such a launch may take (CUDA; auto is off elsewhere)


def continuous_decode_plan(
    steps: int, budget_ms: float | None, *, device_type: str, speculative: bool
) -> tuple[int, float]:
    """``(most steps per launch, budget in seconds)`` from ``--num-continuous-decode-steps`` and
    ``--continuous-decode-budget-ms``; a budget of 0 means "exactly the steps asked for".

    ``steps = 0`` (auto) is continuous decode within :data:`AUTO_DECODE_BUDGET_MS` on CUDA, where a
    small model's step takes less GPU time than the host needs to schedule it; it is off on other
    devices (the host's share of a CPU step is ~1%) and with speculation (whose windows are opted
    into). An explicit step count keeps that count unless a budget is given too.
    """
    if steps == 0:
        if speculative:
            return 1, 0.0
        budget = AUTO_DECODE_BUDGET_MS if budget_ms is None and device_type == "cuda" else budget_ms or 0.0
        return (AUTO_DECODE_STEPS, budget / 1e3) if budget > 0 else (1, 0.0)
    return steps, (budget_ms or 0.0) / 1e3


class DecodePace:
    """Seconds per decode step, from the device time of each decode launch's steps.

    The worker times the steps of every decode launch (``executor.step_timer``): from the moment
    the device starts the first one to the end of the last, so the host's work around a launch
    (building it, reading its tokens) is not a step's, nor are prefills, a jump's lead pass or
    idle time, and a launch queued behind another counts from when that one is done. Divided by
    the launch's steps it is the step time; an exponential average smooths it. The budget then
    bounds the device time of a launch, and a fixed cost per launch never shortens launches
    (which would raise its share of each, and shorten them further).
    """

    ALPHA = 0.25

    def __init__(self) -> None:
        self.per_step: float | None = None

    def decode_processed(self, time: StepTime | None) -> None:
        """A decode launch's tokens were read; ``time``: its steps' device time (None: untimed)."""
        if time is None or time.steps < 1:
            return
        sample = max(time.read(), 0.0) / time.steps
        old = self.per_step
        self.per_step = sample if old is None else old + self.ALPHA * (sample - old)

    def steps_within(self, budget_s: float, cap: int) -> int:
        """Steps of one launch that fit ``budget_s`` at the measured pace, 1 to ``cap``; 1 until
        a step was measured."""
        if self.per_step is None:
            return 1
        if self.per_step <= 0:
            return cap
        return max(1, min(cap, int(budget_s / self.per_step + 1e-9)))  # 8 ms / 2 ms is 4, not 3.99...
