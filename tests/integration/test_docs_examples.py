"""The README's and the user guides' Python examples run as written against a server on the default model: every
```python block of a guide, in order, in one namespace (a later block may use what an earlier one
defined), with the guide's address (``http://127.0.0.1:30000``) pointed at the test server. A block
that raises (an ``assert`` in it, a refused request, output that does not parse) fails its guide,
and so does a block that prints nothing although it calls ``print``."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# guide -> the fewest examples it holds
GUIDES = {
    "README.md": 2,
    "docs/getting-started.md": 5,
    "docs/openai-api.md": 4,
    "docs/structured-output.md": 5,
    "docs/tool-calling.md": 5,
}
ADDRESS = "http://127.0.0.1:30000"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def examples(guide: str) -> list[str]:
    return BLOCK.findall((ROOT / guide).read_text())


@pytest.mark.parametrize("guide", GUIDES)
def test_guide_has_examples_that_use_the_documented_address(guide):
    blocks = examples(guide)
    assert len(blocks) >= GUIDES[guide], guide
    assert all(ADDRESS in b for b in blocks if "OpenAI(" in b or "requests.post" in b or "RuntimeEndpoint(" in b)


@pytest.mark.parametrize("guide", GUIDES)
def test_guide_examples_run(server, guide):
    namespace: dict = {"__name__": "__main__"}
    for i, block in enumerate(examples(guide)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block.replace(ADDRESS, server.url), f"{guide}[{i}]", "exec"), namespace)
        assert out.getvalue().strip() or "print(" not in block, f"{guide} block {i} printed nothing"
