"""The same DSL over an OpenAI-compatible API: here our own server's ``/v1``.

An assistant turn's ``gen`` becomes a chat completion; ``select`` uses ``/completions`` with ``echo``
and ``logprobs``. Needs a running server:

    python -m phloem serve --port 30000 &
    python examples/openai_backend.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import requests
from connect import cli_target, served

import phloem as ph


@ph.function
def ask(s, question):
    s += ph.system("Answer in one short sentence.")
    s += ph.user(question)
    s += ph.assistant(ph.gen("answer", max_tokens=12, temperature=0))
    s += ph.user("Is that answer about a city? Reply yes or no.")
    s += ph.assistant(ph.select("is_city", choices=["yes", "no"]))


def main(url: str | None = None) -> ph.ProgramState:
    """Ask through ``{url}/v1`` (a server started here when ``url`` is None); returns the state."""
    with served(url) as root:
        base = root.rstrip("/") + "/v1"
        model = requests.get(base + "/models", timeout=30).json()["data"][0]["id"]
        backend = ph.OpenAIBackend(base, model, api_key="unused")
        state = ask.run(question="What is the capital of France?", backend=backend)
    print("answer:", state["answer"], "| is_city:", state["is_city"])
    return state


if __name__ == "__main__":
    main(cli_target(__doc__))
