"""An agent loop: the model picks a tool with ``select``, writes its argument under a regex constraint,
the program runs the tool and appends the observation, until the model picks ``finish``.

    python examples/agent_tools.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

from connect import Target, cli_target, connect

import phloem as ph

CAPITALS = {"france": "Paris", "italy": "Rome", "japan": "Tokyo", "peru": "Lima"}


def calculator(expression: str) -> str:
    """Evaluate ``a op b`` with integers (the argument's regex allows nothing else)."""
    a, op, b = expression.split()
    x, y = int(a), int(b)
    return str({"+": x + y, "-": x - y, "*": x * y}[op])


def capital(country: str) -> str:
    return CAPITALS.get(country.strip().lower(), "unknown")


# tool name -> (the function, the regex its argument must match)
TOOLS = {
    "calculator": (calculator, r"[0-9]{1,4} [-+*] [0-9]{1,4}"),
    "capital": (capital, r"[A-Z][a-z]{2,11}"),
}
MAX_STEPS = 3


@ph.function
def agent(s, task):
    s += (
        "You can call tools. calculator takes 'a op b'; capital takes a country name; "
        "finish ends the task.\n\n"
        "Task: What is 15 + 27?\nStep 1 tool: calculator\nArgument: 15 + 27\nObservation: 42\n"
        "Step 2 tool: finish\nFinal answer: 42\n\n"
        f"Task: {task}\n"
    )
    for step in range(MAX_STEPS):
        s += f"Step {step + 1} tool: " + ph.select(f"tool{step}", choices=[*TOOLS, "finish"])
        name = s[f"tool{step}"]
        if name == "finish":
            break
        fn, pattern = TOOLS[name]
        s += "\nArgument: " + ph.gen(f"arg{step}", regex=pattern, max_tokens=8, temperature=0)
        s += f"\nObservation: {fn(s[f'arg{step}'])}\n"
    s += "\nFinal answer:" + ph.gen("answer", max_tokens=8, stop="\n", temperature=0)


def steps_of(state: ph.ProgramState) -> list[dict[str, str]]:
    """The tool calls a finished run made, as ``{"tool", "arg"}`` dicts."""
    steps = []
    for i in range(MAX_STEPS):
        tool = state.get(f"tool{i}")
        if tool is None or tool == "finish":
            break
        steps.append({"tool": tool, "arg": state[f"arg{i}"]})
    return steps


def main(target: Target = None) -> ph.ProgramState:
    """Run one task; returns the state (``steps_of(state)`` lists the tool calls)."""
    with connect(target) as backend:
        state = agent.run(task="What is 12 * 7?", backend=backend)
        print(state.text())
    return state


if __name__ == "__main__":
    main(cli_target(__doc__))
