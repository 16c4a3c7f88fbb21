"""Fixtures shared across test modules (opt-in: ``pytestmark = pytest.mark.usefixtures(...)``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for the module: on two cores shared with other jobs, one thread is far
    faster than two fighting (CPU model tests)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
