"""Turns per-request results into a report: throughput, latency percentiles, cache hits, checks.

Token counts come from two places: the server (``meta_info.completion_tokens`` or ``usage``) and
the client, which retokenizes the returned text. Retokenizing can merge or split a token at the
edges, so the totals may differ a little; a difference over ``TOKEN_TOLERANCE`` is reported as an
error, because it means the server's count (or its text) is wrong.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from phloem.bench.client import Result

TOKEN_TOLERANCE = 0.05  # relative difference allowed between server and client output-token totals
TOKEN_SLACK = 2  # plus this many tokens per request
PERCENTILES = (50, 90, 99)
Grammar = dict[str, Any]  # the keyword arguments of ``validity.output_ok``: json_schema= or regex=
LATENCY_KEYS = ("ttft", "itl", "tpot", "e2e_latency")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (``numpy.percentile``'s default) of a non-empty sequence."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float], name: str) -> dict[str, float]:
    """``mean_<name>_ms``, ``median_<name>_ms``, ``p90_...``, ``p99_...`` of values in seconds."""
    if not values:
        return {f"{k}_{name}_ms": 0.0 for k in ("mean", "median", "p90", "p99")}
    ms = [v * 1000 for v in values]
    out = {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms)}
    out |= {f"p{q}_{name}_ms": percentile(ms, q) for q in PERCENTILES if q != 50}
    return out


def tpot(r: Result) -> float | None:
    """Time per output token after the first; None for one-token outputs."""
    n = r.server_output_tokens or r.client_output_tokens
    return (r.latency - r.ttft) / (n - 1) if n > 1 else None


def output_tokens(r: Result) -> int:
    return r.server_output_tokens if r.server_output_tokens is not None else r.client_output_tokens


def token_check(
    ok: Sequence[Result],
    vocab: tuple[int, int] | None = None,
    constrained: Collection[tuple[int, int]] = (),
) -> dict[str, Any]:
    """Server vs client output-token totals over requests where the server gave a count.

    ``vocab``: (the model's vocabulary size, the tokenizer's), given for random (dummy) weights,
    which emit any id of the model's vocabulary. With more ids than its tokenizer (a large shape
    read through a small test tokenizer) such a model emits ids that decode to nothing, so the
    retokenized count cannot match; the check is then recorded as not applicable
    (``token_count_check``) instead of failing the run. ``constrained``: the (session, turn) keys of
    grammar-constrained requests, left out of the comparison: a grammar lets the model spell text in
    tokens the tokenizer would not pick (``"``, ``:`` and a space apart), so their retokenized
    count is lower by design; their totals are still reported."""
    counted = [r for r in ok if r.server_output_tokens is not None]
    checked = [r for r in counted if (r.sid, r.turn) not in constrained]
    server = sum(r.server_output_tokens or 0 for r in checked)
    client = sum(r.client_output_tokens for r in checked)
    allowed = TOKEN_TOLERANCE * max(server, client) + TOKEN_SLACK * len(checked)
    check = "done"
    if vocab is not None and vocab[0] > vocab[1]:
        check = f"not applicable: the model has {vocab[0]:,} token ids, the tokenizer {vocab[1]:,}"
    elif counted and not checked:
        check = "not applicable: every output was constrained by a grammar"
    return {
        "total_output_tokens_server": sum(r.server_output_tokens or 0 for r in counted) if counted else None,
        "total_output_tokens_retokenized": sum(r.client_output_tokens for r in ok),
        "token_count_mismatch": check == "done" and bool(checked) and abs(server - client) > allowed,
        "token_count_check": check,
        "requests_without_server_count": len(ok) - len(counted),
        "requests_not_token_checked": len(counted) - len(checked),
    }


def cache_hit_rate(ok: Sequence[Result], scraped: dict[str, float] | None) -> tuple[float | None, str]:
    """From the ``/metrics`` counter deltas when scraped, else from each response's cached tokens."""
    if scraped and scraped.get("prompt_tokens_total", 0) > 0:
        return scraped.get("cached_tokens_total", 0.0) / scraped["prompt_tokens_total"], "metrics"
    counted = [r for r in ok if r.cached_tokens is not None and r.server_prompt_tokens]
    prompt = sum(r.server_prompt_tokens or 0 for r in counted)
    if not prompt:
        return None, "unavailable"
    return sum(r.cached_tokens or 0 for r in counted) / prompt, "responses"


def cut_by_length(r: Result) -> bool:
    """The reply stopped at ``max_new_tokens`` (native ``{"type": "length"}`` or OpenAI's ``"length"``)."""
    reason = r.finish_reason
    return reason == "length" or (isinstance(reason, dict) and reason.get("type") == "length")


def grammar_check(ok: Sequence[Result], constrained: Mapping[tuple[int, int], Grammar]) -> dict[str, Any]:
    """How many constrained outputs break their grammar (``validity.output_ok``: a reply cut at its
    length must be a valid start), and the valid fraction; None when nothing was constrained."""
    from phloem.bench.validity import output_ok

    rows = [(r, constrained[r.sid, r.turn]) for r in ok if (r.sid, r.turn) in constrained]
    if not rows:
        return {"constrained_valid_rate": None, "constrained_invalid": None}
    bad = sum(not output_ok(r.text, finished=not cut_by_length(r), **g) for r, g in rows)
    return {"constrained_valid_rate": 1 - bad / len(rows), "constrained_invalid": bad}


def summarize(
    results: Sequence[Result],
    duration: float,
    *,
    scraped: dict[str, float] | None = None,
    constrained: Mapping[tuple[int, int], Grammar] | None = None,
    vocab: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The report's metrics (configuration fields are added by the caller); ``vocab`` as in
    :func:`token_check`; ``constrained``: the grammar of each constrained (session, turn)."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    input_tokens = sum(r.server_prompt_tokens or r.prompt_len for r in ok)
    out_tokens = sum(output_tokens(r) for r in ok)
    hit, source = cache_hit_rate(ok, scraped)
    report: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_throughput": input_tokens / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_throughput": (input_tokens + out_tokens) / duration if duration else 0.0,
        "concurrency": sum(r.latency for r in ok) / duration if duration else 0.0,
        "cache_hit_rate": hit,
        "cache_hit_rate_source": source,
    }
    report |= grammar_check(ok, constrained or {})
    report |= token_check(ok, vocab, (constrained or {}).keys())
    report |= distribution([r.ttft for r in ok], "ttft")
    report |= distribution([x for r in ok for x in r.itl], "itl")
    report |= distribution([t for r in ok if (t := tpot(r)) is not None], "tpot")
    report |= distribution([r.latency for r in ok], "e2e_latency")
    report["errors"] = error_list(failed, report)
    return report


def error_list(failed: Sequence[Result], report: dict[str, Any], limit: int = 10) -> list[str]:
    """Distinct failure messages (at most ``limit``), plus the token-count check."""
    seen: dict[str, int] = {}
    for r in failed:
        seen[r.error] = seen.get(r.error, 0) + 1
    errors = [f"{n} x {msg}" for msg, n in list(seen.items())[:limit]]
    if report.get("token_count_mismatch"):
        errors.append(
            "output token count mismatch: server counted "
            f"{report['total_output_tokens_server']}, client retokenized "
            f"{report['total_output_tokens_retokenized']}"
        )
    if report.get("constrained_invalid"):
        errors.append(f"{report['constrained_invalid']} constrained outputs break their grammar")
    return errors


# ---- printing and files ----------------------------------------------------------------------------
def format_report(report: dict[str, Any]) -> str:
    """A fixed-width block like SGLang's bench_serving summary."""
    rows = [
        ("Backend", report.get("backend")),
        ("Dataset", report.get("dataset")),
        ("Max concurrency", report.get("max_concurrency")),
        ("Request rate", report.get("request_rate")),
        ("Successful requests", report["completed"]),
        ("Failed requests", report["failed"]),
        ("Duration (s)", report["duration_s"]),
        ("Total input tokens", report["total_input_tokens"]),
        ("Output tokens (server)", report["total_output_tokens_server"]),
        ("Output tokens (retokenized)", report["total_output_tokens_retokenized"]),
        (
            "Token count check",
            None if report.get("token_count_check", "done") == "done" else "not applicable",
        ),
        ("Request throughput (req/s)", report["request_throughput"]),
        ("Input throughput (tok/s)", report["input_throughput"]),
        ("Output throughput (tok/s)", report["output_throughput"]),
        ("Mean in flight", report["concurrency"]),
        ("Cache hit rate", report["cache_hit_rate"]),
        ("Constrained valid rate", report["constrained_valid_rate"]),
    ]
    for key in LATENCY_KEYS:
        for stat in ("mean", "median", "p90", "p99"):
            rows.append(
                (f"{stat.capitalize()} {key.upper().replace('_', ' ')} (ms)", report[f"{stat}_{key}_ms"])
            )
    lines = [f"{'=' * 22} Serving benchmark {'=' * 22}"]
    lines += [f"{name:<40}{_fmt(value):>22}" for name, value in rows if value is not None]
    lines += [f"ERROR: {e}" for e in report["errors"]]
    lines.append("=" * 62)
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def append_jsonl(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def parse_prometheus(text: str, prefix: str = "phloem:") -> dict[str, float]:
    """``{name_without_prefix: value}`` of un-bucketed samples (labels dropped, values summed)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0][len(prefix) :]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if k.endswith("_total")}


def emit_json(result: dict[str, Any], path: str | None) -> None:
    """Print ``result`` as JSON and, with ``path``, write it there too (one-shot benchmarks)."""
    print(json.dumps(result, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
