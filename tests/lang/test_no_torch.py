"""``import phloem.lang`` must work where torch is not installed."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
sys.modules['torch'] = None  # any 'import torch' now raises ImportError
import phloem.lang
import phloem as ph
assert ph.gen is phloem.lang.gen
bad = [m for m in sys.modules if m.startswith('phloem.runtime')]
assert not bad, bad
print('ok')
"""


def test_import_without_torch():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_every_public_name_is_exported():
    import phloem.lang

    import phloem

    for name in phloem.lang.__all__:
        assert getattr(phloem, name) is getattr(phloem.lang, name)
