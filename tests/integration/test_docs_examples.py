"""The user guides' Python examples run as written against a server on the default model: every
```python block of each guide, in order, with the guide's address (``http://127.0.0.1:30000``)
pointed at the test server. A block that raises (an ``assert`` in it, a refused request, output
that does not parse) fails its case."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDES = ["docs/structured-output.md"]
ADDRESS = "http://127.0.0.1:30000"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def examples(guide: str) -> list[str]:
    return BLOCK.findall((ROOT / guide).read_text())


CASES = [(guide, i) for guide in GUIDES for i in range(len(examples(guide)))]


def test_every_guide_has_examples_and_uses_the_documented_address():
    for guide in GUIDES:
        blocks = examples(guide)
        assert blocks, guide
        assert all(ADDRESS in block for block in blocks), guide


@pytest.mark.parametrize(("guide", "index"), CASES, ids=[f"{g.split('/')[-1]}-{i}" for g, i in CASES])
def test_example_runs(server, guide, index):
    code = examples(guide)[index].replace(ADDRESS, server.url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{guide}[{index}]", "exec"), {"__name__": "__main__"})
    assert out.getvalue().strip(), "the example printed nothing"
