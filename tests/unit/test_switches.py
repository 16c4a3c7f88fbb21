"""The environment switch registry: the only reader of ``PHLOEM_*`` variables, every switch
documented, values read on use rather than at import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from phloem.runtime import switches
from phloem.runtime.switches import SWITCHES, Switch

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ["phloem", "lang", "runtime", "grammars", "training"]
REGISTRY = ROOT / "runtime" / "switches.py"


def _switch_literals(path: Path) -> list[str]:
    """String constants in ``path`` that name a switch variable (docstrings may mention one)."""
    names = {sw.name for sw in SWITCHES}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith("PHLOEM_") or node.value in names:
                found.append(node.value)
    return found


def test_only_the_registry_names_a_switch_variable():
    offenders = []
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != REGISTRY and (hits := _switch_literals(path)):
                offenders.append(f"{path.relative_to(ROOT)}: {', '.join(sorted(set(hits)))}")
    assert not offenders, "read these through phloem.runtime.switches:\n" + "\n".join(offenders)


def test_every_switch_is_documented_once_with_a_meaning():
    doc = (ROOT / "docs" / "config.md").read_text()
    assert len({sw.name for sw in SWITCHES}) == len(SWITCHES)
    for sw in SWITCHES:
        assert sw.meaning and f"`{sw.name}`" in doc, sw.name


def test_values_are_read_when_asked(monkeypatch):
    monkeypatch.delenv(switches.PDL.name, raising=False)
    assert switches.PDL.flag() is True
    monkeypatch.setenv(switches.PDL.name, "0")
    assert switches.PDL.flag() is False
    monkeypatch.setenv(switches.DISABLE_FUSED_KERNELS.name, "yes")  # off by default: on only for "1"
    assert switches.DISABLE_FUSED_KERNELS.flag() is False
    monkeypatch.setenv(switches.DECODE_PREFETCH_PAIRS.name, "7")
    assert switches.DECODE_PREFETCH_PAIRS.number() == 7


def test_malformed_values_raise(monkeypatch):
    monkeypatch.setenv(switches.ROW_FUSION_MAX_K.name, "many")
    with pytest.raises(ValueError, match="integer"):
        switches.ROW_FUSION_MAX_K.read()
    monkeypatch.setenv(switches.EXTEND_KERNEL.name, "contigous")
    with pytest.raises(ValueError, match="one of"):
        switches.EXTEND_KERNEL.read()


def test_switch_kinds_match_defaults():
    for sw in SWITCHES:
        assert isinstance(sw, Switch) and isinstance(sw.default, sw.kind), sw.name
