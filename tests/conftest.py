"""pytest fixtures; the helpers themselves live in tests/fixtures/: fakes/ (imported as `fixtures.fakes.*`) and workers/
(programs run as worker subprocesses)."""
from __future__ import annotations

import pytest

from fixtures.fakes.workers import PYTHON, make_config


@pytest.fixture
def python_exe() -> str:
    return PYTHON


@pytest.fixture
def config_factory(tmp_path):
    """make_config bound to this test's tmp_path."""
    return lambda **overrides: make_config(tmp_path, **overrides)


@pytest.fixture
def sigint_default():
    """Children this test starts get SIGINT's default action.  A test run launched as a background job of a
    non-interactive shell (`pytest … &`) has SIGINT ignored, and an ignored signal is inherited across exec: a
    child the test means to interrupt would then never hear it."""
    import signal

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
