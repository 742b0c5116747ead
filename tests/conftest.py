"""pytest fixtures; the helpers themselves live in tests/fixtures/ (imported as `fixtures.*`)."""
from __future__ import annotations

import pytest

from fixtures.workers import PYTHON, make_config


@pytest.fixture
def python_exe() -> str:
    return PYTHON


@pytest.fixture
def config_factory(tmp_path):
    """make_config bound to this test's tmp_path."""
    return lambda **overrides: make_config(tmp_path, **overrides)
