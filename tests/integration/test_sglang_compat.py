"""SGLang's own frontend (its HTTP RuntimeEndpoint backend) runs unchanged against phloem serve."""

from __future__ import annotations

import pytest

sgl = pytest.importorskip("sglang", reason="compat tests need sglang installed with --no-deps (make test does)")

pytestmark = pytest.mark.compat


def test_sglang_program_with_gen_select_and_fork(server):
    backend = sgl.RuntimeEndpoint(server.url)

    @sgl.function
    def quiz(s, city):
        s += "Question: Which country is " + city + " in?\n"
        s += "Answer: " + sgl.select("country", choices=["France", "Japan", "Brazil"]) + "\n"
        s += "A short fact about " + city + ":" + sgl.gen("fact", max_tokens=12, stop="\n", temperature=0)
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"\nIdea {i + 1}:" + sgl.gen("idea", max_tokens=8, temperature=0)
        forks.join()

    state = quiz.run(city="Paris", backend=backend)
    assert state["country"] == "France"
    assert isinstance(state["fact"], str)
    assert "Question: Which country is Paris in?" in state.text()

    states = quiz.run_batch([{"city": "Tokyo"}, {"city": "Paris"}], backend=backend)
    assert [st["country"] for st in states] == ["Japan", "France"]
