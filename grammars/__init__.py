"""Constrained decoding: grammar backends, matchers, masks, jump-forward and tool-call formats.

Importing this package loads no grammar library; backends are imported by
:func:`phloem.grammars.registry.create_backend`.
"""

from __future__ import annotations

from .base import CompiledGrammar, GrammarBackend, GrammarError, GrammarKind, GrammarMatcher, GrammarSpec
from .registry import BACKEND_NAMES, DEFAULT_BACKEND, create_backend

__all__ = [
    "BACKEND_NAMES",
    "DEFAULT_BACKEND",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarError",
    "GrammarKind",
    "GrammarMatcher",
    "GrammarSpec",
    "create_backend",
]
