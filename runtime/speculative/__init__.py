"""Speculative decoding (docs/design.md §7): n-gram and EAGLE proposers, tree verification, head training.

Importing this package is cheap; the modules load torch when imported themselves.
"""

from __future__ import annotations

import os

DEFAULT_EAGLE_HEAD = os.path.join(os.path.dirname(__file__), "assets", "smollm2_135m_eagle.safetensors")

ALGORITHMS = ("EAGLE", "NGRAM")  # values of EngineArgs.speculative_algorithm

__all__ = ["ALGORITHMS", "DEFAULT_EAGLE_HEAD"]
