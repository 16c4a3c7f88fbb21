from __future__ import annotations

import pytest
from phloem.lang import EngineBackend, set_default_backend

from tests.lang.lang_fakes import FakeEngine


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def backend(engine: FakeEngine) -> EngineBackend:
    return EngineBackend(engine)


@pytest.fixture(autouse=True)
def _no_default_backend():
    set_default_backend(None)
    yield
    set_default_backend(None)
