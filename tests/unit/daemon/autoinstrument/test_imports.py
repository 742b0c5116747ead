"""The post-import hook registry (daemon/autoinstrument/imports.py), with fake modules written to tmp_path."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from hangwatch.daemon.autoinstrument.imports import PostImportHooks


@pytest.fixture
def fake_modules(tmp_path, monkeypatch):
    """A package `hwfake_<n>` with modules `a` (a function), `boom` (raises at import) and `sub.deep`."""
    name = f"hwfake_{tmp_path.name.replace('-', '_')}"
    pkg = tmp_path / name
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        textwrap.dedent("""
        import sys
        def save(x):
            return ("saved", x)
        ORDER = list(getattr(sys, "_hwfake_order", []))
    """)
    )
    (pkg / "boom.py").write_text("raise RuntimeError('the module itself fails')\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "deep.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


@pytest.fixture
def hooks():
    errors = []
    h = PostImportHooks(on_error=lambda name, cb, exc: errors.append((name, exc)))
    h.errors = errors
    yield h
    h.uninstall()
    assert all(f is not h for f in sys.meta_path)


def test_a_callback_runs_right_after_the_module_executes_and_may_wrap_it(fake_modules, hooks):
    seen = []

    def patch(module):
        seen.append(sorted(k for k in vars(module) if not k.startswith("_")))
        original = module.save
        module.save = lambda x: ("wrapped",) + original(x)

    hooks.register(f"{fake_modules}.a", patch)
    assert hooks.pending() == [f"{fake_modules}.a"] and sys.meta_path[0] is hooks
    from importlib import import_module

    a = import_module(f"{fake_modules}.a")
    assert seen == [["ORDER", "save", "sys"]]  # the whole module body had run
    assert a.save(1) == ("wrapped", "saved", 1)
    # `from … import save` after the import binds the wrapper: the point of hooking before anyone else does
    ns: dict = {}
    exec(f"from {fake_modules}.a import save", ns)
    assert ns["save"](2) == ("wrapped", "saved", 2)
    # nothing else about the module changed: its loader is the one the import system found
    assert type(a.__loader__).__name__ == "SourceFileLoader" and "exec_module" not in vars(a.__loader__)
    assert a.__spec__.origin.endswith("a.py")
    # one-shot: the finder leaves sys.meta_path once nothing is pending
    assert hooks.pending() == [] and all(f is not hooks for f in sys.meta_path)


def test_an_already_imported_module_gets_the_callback_at_once(fake_modules, hooks):
    mod = importlib.import_module(f"{fake_modules}.sub.deep")
    got = []
    hooks.register(f"{fake_modules}.sub.deep", got.append)
    assert got == [mod] and hooks.pending() == []


def test_a_nested_module_is_hooked_too(fake_modules, hooks):
    got = []
    hooks.register(f"{fake_modules}.sub.deep", lambda m: got.append(m.VALUE))
    importlib.import_module(f"{fake_modules}.sub.deep")
    assert got == [41]


def test_a_failing_callback_is_reported_and_the_import_still_succeeds(fake_modules, hooks):
    later = []

    def broken(module):
        raise KeyError("hangwatch's own bug")

    hooks.register(f"{fake_modules}.a", broken)
    hooks.register(f"{fake_modules}.a", later.append)
    a = importlib.import_module(f"{fake_modules}.a")
    assert a.save(3) == ("saved", 3)
    assert [(n, type(e)) for n, e in hooks.errors] == [(f"{fake_modules}.a", KeyError)]
    assert later == [a]  # the other callbacks of the module still ran


def test_a_module_that_fails_by_itself_fails_as_it_would_have_and_gets_no_callback(fake_modules, hooks):
    got = []
    hooks.register(f"{fake_modules}.boom", got.append)
    with pytest.raises(RuntimeError, match="the module itself fails"):
        importlib.import_module(f"{fake_modules}.boom")
    assert got == [] and hooks.errors == []
    assert hooks.pending() == [f"{fake_modules}.boom"]  # a later successful import would still be hooked


def test_an_unknown_module_is_left_to_the_other_finders(fake_modules, hooks):
    hooks.register(f"{fake_modules}.missing", lambda m: None)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"{fake_modules}.missing")
    assert hooks.find_spec("json", None) is None  # not watched: not even looked for
