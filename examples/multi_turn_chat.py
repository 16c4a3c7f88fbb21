"""A multi-turn chat: each turn's reply is generated, then the conversation goes on from it.

python examples/multi_turn_chat.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

from connect import Target, cli_target, connect

import phloem as ph

QUESTIONS = ["Name a fruit that is red.", "What colour is it inside?", "Say thank you."]


@ph.function
def chat(s, questions):
    s += ph.system("You are a helpful assistant. Answer in one short sentence.")
    for i, question in enumerate(questions):
        s += ph.user(question)
        s += ph.assistant(ph.gen(f"reply{i}", max_tokens=12, temperature=0))


def main(target: Target = None) -> ph.ProgramState:
    """Run the conversation; returns the finished state (``state.messages()`` has every turn)."""
    with connect(target) as backend:
        state = chat.run(questions=QUESTIONS, backend=backend)
        for message in state.messages():
            print(f"{message['role']:>9}: {message['content']}")
    return state


if __name__ == "__main__":
    main(cli_target(__doc__))
