"""``run_batch`` over 64 inputs with a progress bar. The few-shot stem every program starts with is
sent once before the batch, so the server computes it once.

    python examples/batch_progress.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

from connect import Target, cli_target, connect

import phloem as ph

SHOTS = [
    ("I loved every minute of it.", "positive"),
    ("The food was cold and the waiter rude.", "negative"),
    ("What a wonderful, sunny day!", "positive"),
    ("This is the worst phone I have owned.", "negative"),
]
GOOD = ["great", "lovely", "excellent", "delightful", "superb", "fantastic", "charming", "brilliant"]
BAD = ["awful", "terrible", "horrible", "dreadful", "boring", "broken", "disgusting", "useless"]
THINGS = ["film", "meal", "hotel", "book"]
INPUTS = [f"The {thing} was {word}." for word in GOOD + BAD for thing in THINGS]  # 64 reviews
LABELS = ["positive", "negative"]


@ph.function
def classify(s, review):
    s += "Classify the sentiment of each review.\n\n"
    for text, label in SHOTS:
        s += f"Review: {text}\nSentiment: {label}\n\n"
    s += f"Review: {review}\nSentiment: " + ph.select("label", choices=LABELS)


def main(target: Target = None, *, reviews: list[str] = INPUTS) -> list[ph.ProgramState]:
    """Classify every review; returns the states in input order."""
    with connect(target) as backend:
        states = classify.run_batch([{"review": r} for r in reviews], backend=backend, progress_bar=True)
    labels = [st.get("label") for st in states]
    print(
        {label: labels.count(label) for label in LABELS},
        "errors:",
        sum(st.error() is not None for st in states),
    )
    return states


if __name__ == "__main__":
    main(cli_target(__doc__))
