"""Few-shot question answering: a constant block of examples, then one question per program.

python examples/few_shot_qa.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

from connect import Target, cli_target, connect

import phloem as ph

EXAMPLES = [
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Spain?", "Madrid"),
]
QUESTIONS = ["What is the capital of France?", "What is the capital of England?"]


@ph.function
def few_shot_qa(s, question):
    s += "Answer each question with one word.\n\n"
    for q, a in EXAMPLES:
        s += f"Q: {q}\nA: {a}\n\n"
    s += f"Q: {question}\nA:" + ph.gen("answer", max_tokens=4, stop="\n", temperature=0)


def main(target: Target = None) -> dict[str, str]:
    """Answer :data:`QUESTIONS`; returns ``{question: answer}``."""
    with connect(target) as backend:
        states = few_shot_qa.run_batch([{"question": q} for q in QUESTIONS], backend=backend)
        answers = {q: st["answer"].strip() for q, st in zip(QUESTIONS, states)}
    for q, a in answers.items():
        print(f"{q} -> {a}")
    return answers


if __name__ == "__main__":
    main(cli_target(__doc__))
