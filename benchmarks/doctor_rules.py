"""``phloem doctor``'s rules: findings from the gauges a server reported over one workload run.

A :class:`Snapshot` holds what the doctor read: the server's configuration (``/get_server_info``),
its live stats sampled during the run (running and queued requests, KV pool usage), the run's
counter deltas and latency percentiles (``/metrics``), and the prefix reports of its requests.
Each rule reads the snapshot and returns a :class:`Finding`: whether a setting should change, the
evidence, and the flag with a suggested value. Rules run in a fixed order (memory first: a pool
too small distorts every later figure) and never touch the server; :func:`diagnose` runs them all.

Thresholds are round numbers chosen to flag settings that are clearly off, not to fine-tune:
a pool is "full" at 90 % usage, "idle" under 70 %; latency figures need a handful of samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FULL_POOL = 0.90  # token usage at which the KV pool counts as full
ROOMY_POOL = 0.70  # token usage under which more running requests would still fit
LPM_MAX_QUEUE = 128  # the scheduler's lpm falls back to arrival order past this many waiting
SHARED_WORKLOAD = 0.30  # share of prompt tokens reusable from other requests that counts as "many share"
ITL_SPIKE = 4.0  # p99 / p50 inter-token latency ratio that says prefills stall decodes
MIN_LATENCY_SAMPLES = 8  # requests needed before latency percentiles say anything
SUSTAINED = 0.25  # share of the samples a condition must hold in (a burst of arrivals queues briefly)


@dataclass
class Snapshot:
    """What the doctor read from one run (see the module docstring)."""

    config: dict[str, Any]  # /get_server_info (flags and start-up figures), without "live"
    samples: list[dict[str, float]] = field(default_factory=list)  # "live" stats, sampled over the run
    counters: dict[str, float] = field(default_factory=dict)  # /metrics counter deltas (``*_total``)
    latency: dict[str, float] = field(default_factory=dict)  # ttft_p50/p99, itl_p50/p99 (s) from /metrics
    requests: int = 0
    prefix_groups: list[dict[str, Any]] = field(default_factory=list)  # prefix_summary groups (dicts)
    shared_ceiling: float = 0.0  # share of the workload's prompt tokens another request also sends first

    def peak(self, name: str) -> float:
        return max((s.get(name, 0.0) for s in self.samples), default=0.0)

    def mean(self, name: str) -> float:
        return sum(s.get(name, 0.0) for s in self.samples) / len(self.samples) if self.samples else 0.0

    def share(self, holds: Callable[[dict[str, float]], bool]) -> float:
        """The share of the samples in which ``holds`` is true."""
        return sum(1 for s in self.samples if holds(s)) / len(self.samples) if self.samples else 0.0

    @property
    def on_cuda(self) -> bool:
        return str(self.config.get("device", "")).startswith("cuda")

    @property
    def hit_rate(self) -> float:
        prompt = self.counters.get("prompt_tokens_total", 0.0)
        return self.counters.get("cached_tokens_total", 0.0) / prompt if prompt else 0.0


@dataclass
class Finding:
    rule: str
    title: str
    fired: bool
    evidence: str
    flag: str = ""  # the flag to change, e.g. "--max-running-requests"
    value: str | None = None  # its suggested value; None for a switch (or no engine flag)
    advice: str = ""

    @property
    def change(self) -> dict[str, str | None]:
        """The flag change ``--apply`` makes (empty when the finding names no engine flag)."""
        return {self.flag: self.value} if self.fired and self.flag.startswith("--") else {}


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


# ---- the rules, in report order -------------------------------------------------------------------
def memory(s: Snapshot) -> Finding:
    pool = int(s.config.get("max_total_num_tokens", 0))
    usage, queue, retracted = (
        s.peak("token_usage"),
        s.peak("num_queue_reqs"),
        s.counters.get("num_retracted_reqs_total", 0),
    )
    flag = "--mem-fraction-static" if s.on_cuda else "--max-total-tokens"
    mem = f", {s.config.get('available_mem_gb')} GB free after loading" if s.on_cuda else ""
    evidence = f"KV pool {pool} tokens{mem}; peak usage {_pct(usage)}, peak queue {queue:.0f}, {retracted:.0f} retractions"
    full_and_queued = s.share(
        lambda x: x.get("token_usage", 0) >= FULL_POOL and x.get("num_queue_reqs", 0) > 0
    )
    fired = usage >= FULL_POOL and (retracted > 0 or full_and_queued >= SUSTAINED)
    if not fired:
        return Finding("memory", "start-up memory", False, evidence)
    if s.on_cuda:
        current = float(s.config.get("mem_fraction_static") or 0.85)
        value = f"{min(current + 0.05, 0.95):.2f}"
        advice = "give the KV pool more of the device memory (less headroom for activations)"
    else:
        value = str(pool * 2)
        advice = "the pool filled while requests waited: a larger pool admits more of them"
    return Finding("memory", "start-up memory", True, evidence, flag, value, advice)


def throughput(s: Snapshot) -> Finding:
    cap = int(s.config.get("max_running_requests") or 0)
    running, queue, usage = s.peak("num_running_reqs"), s.peak("num_queue_reqs"), s.peak("token_usage")
    demand = max((x.get("num_running_reqs", 0) + x.get("num_queue_reqs", 0) for x in s.samples), default=0)
    # More requests running or waiting than the cap lets run, in a sustained share of the samples.
    # (Running alone is a poor witness: a request being prefilled is not counted as running yet.)
    over = s.share(lambda x: cap > 0 and x.get("num_running_reqs", 0) + x.get("num_queue_reqs", 0) > cap)
    evidence = (
        f"max_running_requests {cap}; more requests running or queued than that in {_pct(over)} of the "
        f"samples; peak running {running:.0f}, peak queue {queue:.0f}, peak token usage {_pct(usage)}"
    )
    fired = over >= SUSTAINED and usage < ROOMY_POOL
    if not fired:
        return Finding("throughput", "token usage and queue", False, evidence)
    value = str(max(2 * cap, int(demand)))
    advice = "requests queued behind the running cap while the KV pool had room: let more run at once"
    return Finding(
        "throughput", "token usage and queue", True, evidence, "--max-running-requests", value, advice
    )


def retractions(s: Snapshot) -> Finding:
    n = s.counters.get("num_retracted_reqs_total", 0.0)
    cap = int(s.config.get("max_running_requests") or 0)
    evidence = f"{n:.0f} retractions over {s.requests} requests"
    if n <= 0:
        return Finding("retractions", "retractions", False, evidence)
    value = str(max(cap // 2, 1)) if cap else None
    advice = (
        "decoding requests outgrew the pool and were sent back to recompute: run fewer at once "
        "(or give the pool more memory, see above)"
    )
    return Finding("retractions", "retractions", True, evidence, "--max-running-requests", value, advice)


def cuda_graphs(s: Snapshot) -> Finding:
    if not s.on_cuda:
        return Finding("cuda_graphs", "CUDA graphs", False, "not on CUDA: no decode graphs")
    max_bs = int(s.config.get("cuda_graph_max_bs") or 0)
    running = int(s.peak("num_running_reqs"))
    disabled = bool(s.config.get("disable_cuda_graph"))
    evidence = (
        f"graphs captured up to batch {max_bs}{' (disabled)' if disabled else ''}; peak running {running}"
    )
    if disabled or running <= max_bs:
        return Finding("cuda_graphs", "CUDA graphs", False, evidence)
    value = str(1 << (running - 1).bit_length())  # the next power of two
    advice = "decode batches above the largest captured graph run without one (slower steps)"
    return Finding("cuda_graphs", "CUDA graphs", True, evidence, "--cuda-graph-max-bs", value, advice)


def chunked_prefill(s: Snapshot) -> Finding:
    chunk = s.config.get("chunked_prefill_size")
    mixed = bool(s.config.get("enable_mixed_chunk"))
    ttft50, itl50, itl99 = (s.latency.get(k, 0.0) for k in ("ttft_p50", "itl_p50", "itl_p99"))
    evidence = (
        f"chunked_prefill_size {chunk}, mixed chunk {'on' if mixed else 'off'}; TTFT p50 {ttft50 * 1e3:.0f} ms, "
        f"ITL p50 {itl50 * 1e3:.1f} ms, p99 {itl99 * 1e3:.1f} ms"
    )
    if s.requests < MIN_LATENCY_SAMPLES or itl50 <= 0 or itl99 < ITL_SPIKE * itl50:
        return Finding("chunked_prefill", "TTFT vs ITL", False, evidence)
    if not mixed:
        advice = "decode tokens wait behind whole prefill passes: run decode rows inside prefill chunks"
        return Finding("chunked_prefill", "TTFT vs ITL", True, evidence, "--enable-mixed-chunk", None, advice)
    value = str(max(int(chunk or 512) // 2, 64))
    advice = "prefill chunks still stall decodes: smaller chunks trade a little TTFT for steadier ITL"
    return Finding("chunked_prefill", "TTFT vs ITL", True, evidence, "--chunked-prefill-size", value, advice)


def prompt_order(s: Snapshot) -> Finding:
    lost = [g for g in s.prefix_groups if g.get("tokens_lost", 0) > 0]
    prompt = s.counters.get("prompt_tokens_total", 0.0)
    if not lost:
        return Finding(
            "prompt_order",
            "prompt order",
            False,
            f"no prompt rejoins a cached path it left ({s.requests} requests)",
        )
    top = lost[0]
    total = sum(g["tokens_lost"] for g in lost)
    share = f" ({_pct(total / prompt)} of prompt tokens)" if prompt else ""
    evidence = (
        f"{sum(g['count'] for g in lost)} requests recomputed {total} tokens{share} a cached path held; "
        f"the most common break follows {top['before']!r}: the prompt goes on {top['prompt_after'][:30]!r} "
        f"where the cache has {top['cached_after'][:30]!r}"
    )
    advice = "move the text that changes (timestamps, ids, names) after the shared part of the prompt"
    return Finding("prompt_order", "prompt order", True, evidence, "(the prompts)", None, advice)


def schedule_policy(s: Snapshot) -> Finding:
    policy = s.config.get("schedule_policy", "fcfs")
    queue = s.peak("num_queue_reqs")
    queued = s.share(lambda x: x.get("num_queue_reqs", 0) > 0)
    evidence = (
        f"schedule_policy {policy}; {_pct(s.shared_ceiling)} of prompt tokens are shared with another request, "
        f"hit rate {_pct(s.hit_rate)}; requests queued in {_pct(queued)} of the samples, peak queue {queue:.0f}"
    )
    # the order only matters while requests wait, and sorting a long queue costs more than it saves
    fired = (
        policy != "lpm"
        and s.shared_ceiling >= SHARED_WORKLOAD
        and queued >= SUSTAINED
        and queue < LPM_MAX_QUEUE
    )
    if not fired:
        return Finding("schedule_policy", "queue order", False, evidence)
    advice = "admit queued requests that share a cached prefix first (longest prefix match)"
    return Finding("schedule_policy", "queue order", True, evidence, "--schedule-policy", "lpm", advice)


RULES: tuple[Callable[[Snapshot], Finding], ...] = (
    memory,
    throughput,
    retractions,
    cuda_graphs,
    chunked_prefill,
    prompt_order,
    schedule_policy,
)


def diagnose(s: Snapshot) -> list[Finding]:
    """Every rule's finding, in report order."""
    return [rule(s) for rule in RULES]


def suggested_flags(findings: list[Finding]) -> dict[str, str | None]:
    """The engine flag changes of the fired findings (a later rule does not undo an earlier one)."""
    out: dict[str, str | None] = {}
    for f in findings:
        for flag, value in f.change.items():
            out.setdefault(flag, value)
    return out


def format_findings(findings: list[Finding]) -> str:
    lines = []
    for n, f in enumerate(findings, 1):
        head = f"{n}. {f.title}: " + ("CHANGE" if f.fired else "ok")
        lines.append(head)
        lines.append(f"   evidence: {f.evidence}")
        if f.fired:
            flag = f.flag + (f" {f.value}" if f.value is not None else "")
            lines.append(f"   change:   {flag}  ({f.advice})")
    return "\n".join(lines)
