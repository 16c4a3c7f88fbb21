"""Extract a record that matches a pydantic model: the grammar makes the output valid JSON for the
schema, and ``gen(json_schema=Model)`` stores the parsed instance.

    python examples/json_extraction.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

from connect import Target, cli_target, connect
from pydantic import BaseModel, Field

import phloem as ph


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int
    city: str = Field(max_length=24)


TEXT = "Alice Martin is 34 years old and lives in Lyon, where she teaches piano."


@ph.function
def extract(s, text):
    s += ph.system("Extract the person described in the text as JSON.")
    s += ph.user(text)
    s += ph.assistant(ph.gen("person", json_schema=Person, max_tokens=48, temperature=0))


def main(target: Target = None) -> Person:
    """Returns the extracted :class:`Person`."""
    with connect(target) as backend:
        state = extract.run(text=TEXT, backend=backend)
        person = state["person"]
    print(repr(person))
    return person


if __name__ == "__main__":
    main(cli_target(__doc__))
