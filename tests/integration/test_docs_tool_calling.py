"""docs/tool-calling.md's Python examples run as written against a server on the default model.

The blocks run in order in one namespace (later blocks use what earlier ones defined); the only change
is the server address, the doc's ``http://127.0.0.1:30000`` becoming the test server's.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

pytest.importorskip("openai")

DOC = Path(__file__).resolve().parents[2] / "docs" / "tool-calling.md"
DOC_URL = "http://127.0.0.1:30000"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_doc_has_examples():
    blocks = BLOCK.findall(DOC.read_text())
    assert len(blocks) >= 5
    assert all(DOC_URL in b for b in blocks if "OpenAI(" in b or "requests.post" in b)


def test_doc_examples_run(server):
    namespace: dict = {"__name__": "__doc__"}
    for i, block in enumerate(BLOCK.findall(DOC.read_text())):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block.replace(DOC_URL, server.url), f"{DOC.name}[{i}]", "exec"), namespace)
        assert out.getvalue().strip() or "print(" not in block, f"block {i} printed nothing"
