"""Tree of thought: fork into several ideas (their shared prefix is computed once), then let the model
pick the best with ``select``.

    python examples/tree_of_thought.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

from connect import Target, cli_target, connect

import phloem as ph

NUM_IDEAS = 3


@ph.function
def tree_of_thought(s, problem, n=NUM_IDEAS):
    s += ph.system("You are a careful planner.")
    s += ph.user(f"{problem} Give one short first step.")
    branches = s.fork(n)
    for b in branches:
        b += ph.assistant(ph.gen("idea", max_tokens=12, temperature=0.8, stop="\n"))
    branches.join()
    listing = "\n".join(f"{i + 1}. {idea.strip()}" for i, idea in enumerate(s["idea"]))
    s += ph.user(f"Candidate first steps:\n{listing}\nWhich step is best? Answer with its number.")
    s += ph.assistant("The best step is " + ph.select("best", choices=[str(i + 1) for i in range(n)]))


def main(target: Target = None) -> ph.ProgramState:
    """Plan once; returns the state (``state["idea"]`` has one idea per branch, ``state["best"]`` one
    of ``"1"``..``"n"``)."""
    with connect(target) as backend:
        state = tree_of_thought.run(problem="I want to learn to cook.", backend=backend)
        for i, idea in enumerate(state["idea"]):
            print(f"idea {i + 1}: {idea.strip()}")
        print("best:", state["best"], "scores:", [round(x, 3) for x in state.get_meta_info("best")["scores"]])
    return state


if __name__ == "__main__":
    main(cli_target(__doc__))
