"""pytest fixtures; the helpers themselves live in tests/fixtures/: fakes/ (imported as `fixtures.fakes.*`) and workers/
(programs run as worker subprocesses).

CUDA.  Tests marked `gpu` need a real CUDA device and are skipped where torch sees none.  Every other test passes
with or without one: a test about a machine without CUDA fakes its absence (`no_cuda`).  To prove it on a machine
without a GPU, HANGWATCH_TEST_FAKE_CUDA=1 makes torch's availability queries — `torch.cuda.is_available()` and
`torch.cuda.device_count()`, which is all the code consults before it picks a device — say one CUDA device is
there, in this process, for every test not marked `gpu`.  Nothing else is faked: code that then really uses CUDA
(moves a tensor, reads a CUDA RNG state) fails, which is the point — such code is either a test that needs a GPU
(mark it `gpu`) or code that uses CUDA where its config did not ask for it.  Library code that uses the GPU by its
own choice whenever there is one (the HF Trainer saves CUDA RNG states, PEFT loads an adapter onto the GPU) would
fail only for the fake: tests of it are marked `cuda_when_present` and left unfaked.  Subprocesses see the machine
as it is.
"""

from __future__ import annotations

import os

import pytest
from fixtures.fakes.workers import PYTHON, make_config

FAKE_CUDA_ENV = "HANGWATCH_TEST_FAKE_CUDA"


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped where torch sees no CUDA device (asked once, before any test fakes it)."""
    needing = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not needing:
        return
    why = no_cuda_here()
    if why is not None:
        for item in needing:
            item.add_marker(pytest.mark.skip(reason=why))


def no_cuda_here() -> "str | None":
    """Why this machine cannot run a `gpu` test; None when torch sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return "needs a CUDA GPU: torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is false here"
    return None


@pytest.fixture(autouse=True)
def _fake_cuda_present(request, monkeypatch):
    """HANGWATCH_TEST_FAKE_CUDA=1: torch says one CUDA device is there (see the module's docstring)."""
    if os.environ.get(FAKE_CUDA_ENV) != "1" or any(
        request.node.get_closest_marker(m) is not None for m in ("gpu", "cuda_when_present")
    ):
        return
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.fixture
def no_cuda(monkeypatch):
    """torch sees no CUDA device, whatever the machine (and whatever HANGWATCH_TEST_FAKE_CUDA says)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


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
