"""Prefix reports through a real server (default model, CPU): a timestamp written ahead of a long
shared system prompt is named at its position; moving it after the system prompt (the fix the
report suggests) lifts the hit rate to the workload's ceiling. Also ``/debug/prefix`` and
``phloem bench serving --prefix-report``."""

from __future__ import annotations

import pytest
import requests

SYSTEM = (
    "You are a careful assistant for a hardware store. Answer in one short sentence, name the aisle "
    "when you know it, never invent prices, and ask a question back when the request is unclear. "
)
QUESTIONS = ["Where are the nails?", "Do you sell paint?", "Is the store open late?"]


def _stamped(i: int) -> str:
    return f"Time: 10:00:0{i + 1}\n{SYSTEM}Question: {QUESTIONS[i]}\n"


def _fixed(i: int) -> str:
    return f"{SYSTEM}Time: 10:00:0{i + 1}\nQuestion: {QUESTIONS[i]}\n"


def _ids(url: str, text: str) -> list[int]:
    return requests.post(url + "/v1/tokenize", json={"prompt": text}).json()["tokens"]


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _live(url: str) -> dict:
    return requests.get(url + "/get_server_info").json()["live"]


def _run(url: str, prompts: list[str]) -> tuple[list[dict], float]:
    """Send the prompts one after another on an empty cache; their reports and the hit rate the
    server counted."""
    assert requests.post(url + "/flush_cache", json={"timeout": 30}).status_code == 200
    before = _live(url)
    reports = []
    for text in prompts:
        body = {"text": text, "sampling_params": {"max_new_tokens": 1}, "return_prefix_report": True}
        out = requests.post(url + "/generate", json=body).json()
        reports.append(out["meta_info"]["prefix_report"])
        assert reports[-1]["cached_tokens"] == out["meta_info"]["cached_tokens"]
    after = _live(url)
    cached = after["cached_tokens_total"] - before["cached_tokens_total"]
    prompt = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    return reports, cached / prompt


def _ceiling(url: str, prompts: list[str]) -> float:
    """The best hit rate of the workload sent in this order: each prompt reuses its longest common
    prefix with an earlier one (less its last token, which is always computed)."""
    ids = [_ids(url, p) for p in prompts]
    reusable = sum(min(max((_lcp(x, y) for y in ids[:i]), default=0), len(x) - 1) for i, x in enumerate(ids))
    return reusable / sum(len(x) for x in ids)


def test_timestamp_ahead_of_the_system_prompt_is_named_and_fixing_it_reaches_the_ceiling(server):
    url = server.url
    stamped = [_stamped(i) for i in range(len(QUESTIONS))]
    reports, bad_rate = _run(url, stamped)
    assert reports[0]["divergence"] is None  # nothing cached yet
    ids = [_ids(url, p) for p in stamped]
    for i in range(1, len(stamped)):
        d = reports[i]["divergence"]
        assert d is not None, reports[i]
        assert d["token_index"] == max(_lcp(ids[i], ids[j]) for j in range(i))
        assert d["prompt_text_before"].endswith("10:00:0")
        assert d["prompt_text_after"].startswith(f"{i + 1}\n")
        assert d["cached_text_after"][0] in "1234" and d["cached_text_after"][1:].startswith("\nYou are")
        assert d["shared_after"] > 40  # the system prompt rejoins the cached path
        assert reports[i]["prompt_tokens"] == len(ids[i])

    fixed = [_fixed(i) for i in range(len(QUESTIONS))]
    fixed_reports, good_rate = _run(url, fixed)
    ceiling = _ceiling(url, fixed)
    assert good_rate == pytest.approx(ceiling, abs=0.01)
    assert good_rate > bad_rate + 0.3
    # after the system prompt the prompts differ for good: nothing rejoins, nothing to recover
    assert all(r["divergence"] is None or r["divergence"]["shared_after"] == 0 for r in fixed_reports)


def test_debug_prefix_answers_without_running(server):
    url = server.url
    requests.post(url + "/flush_cache", json={"timeout": 30})
    first = _stamped(0)
    requests.post(url + "/generate", json={"text": first, "sampling_params": {"max_new_tokens": 1}})
    before = _live(url)["prompt_tokens_total"]
    by_text = requests.post(url + "/debug/prefix", json={"text": _stamped(1)}).json()
    by_ids = requests.post(url + "/debug/prefix", json={"input_ids": _ids(url, _stamped(1))}).json()
    assert by_text == by_ids
    assert by_text["divergence"]["prompt_text_after"].startswith("2\n")
    assert by_text["cached_tokens"] == by_text["divergence"]["token_index"]
    same = requests.post(url + "/debug/prefix", json={"text": first}).json()
    assert same["divergence"] is None and same["cached_tokens"] == same["prompt_tokens"] - 1
    chat = requests.post(url + "/debug/prefix", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["prompt_tokens"] > 2
    assert _live(url)["prompt_tokens_total"] == before  # nothing ran
    # the OpenAI routes take the same flag and put the report on each choice
    body = {"model": "default", "prompt": _stamped(2), "max_tokens": 1, "return_prefix_report": True}
    done = requests.post(url + "/v1/completions", json=body).json()
    report = done["choices"][0]["prefix_report"]
    assert report["divergence"]["prompt_text_after"].startswith("3\n")
    assert report["cached_tokens"] == done["usage"]["prompt_tokens_details"]["cached_tokens"]
    plain = requests.post(url + "/v1/completions", json=body | {"return_prefix_report": False}).json()
    assert "prefix_report" not in plain["choices"][0]
    for body, field in [
        ({}, "text"),
        ({"text": "a", "input_ids": [1]}, "input_ids"),
        ({"txt": "a"}, "txt"),
        ({"input_ids": [-1]}, "input_ids"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ]:
        r = requests.post(url + "/debug/prefix", json=body)
        assert r.status_code == 400, (body, r.text)
        assert field in r.json()["error"]["param"], (body, r.json())


def test_bench_serving_prints_the_top_divergences(server, capsys):
    pytest.importorskip("aiohttp")
    from phloem.bench import cli

    requests.post(server.url + "/flush_cache", json={"timeout": 30})
    argv = [
        "serving", "--base-url", server.url, "--dataset", "shared-prefix", "--num-groups", "2",
        "--prompts-per-group", "2", "--prefix-len", "32", "--question-len", "20", "--output-len", "1",
        "--max-concurrency", "1", "--warmup-requests", "0", "--disable-tqdm", "--prefix-report",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "Prefix divergences (top" in out and "4 requests" in out
    # each group's later prompts leave the shared prefix at its question: one group per prefix
    lines = [line for line in out.splitlines() if "requests," in line and "tokens lost" in line]
    assert sum(int(line.split(".", 1)[1].split()[0]) for line in lines) == 2, out
    assert all("at token 32" in line or "at token 33" in line for line in lines), out


def test_dsl_names_the_changing_argument_and_reports_the_batch_ratio(server, caplog):
    import logging

    import phloem as ph

    rules = SYSTEM * 2  # over the 200 characters that make a constant text worth a warning

    @ph.function
    def desk(s, now, question):
        s += f"Time: {now}\n{rules}Question: {question}\n"
        s += ph.gen("answer", max_tokens=1)

    calls = [{"now": f"10:00:0{i + 1}", "question": q} for i, q in enumerate(QUESTIONS[:2])]
    with caplog.at_level(logging.INFO, logger="phloem.lang"):
        states = desk.run_batch(calls, backend=ph.RuntimeEndpoint(server.url))
    assert all(s.error() is None for s in states)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "argument 'now'" in warnings[0]
    assert f"{len(chr(10) + rules + 'Question: ')} characters" in warnings[0]
    assert 0 < states.shared_prefix_ratio < 0.2  # only "Time: 10:00:0" is shared
    assert any("share" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
