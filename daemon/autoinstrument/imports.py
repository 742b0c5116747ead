"""Post-import hooks: run a callback right after a named module has finished executing.

    hooks = PostImportHooks(on_error=lambda name, callback, exc: ...)
    hooks.register("torch.serialization", patch_save)   # at once when torch.serialization is already imported

Why after, and why this way: hangwatch must wrap functions (`torch.save`, `safetensors.torch.save_file`, …)
before anyone else binds them (`from safetensors.torch import save_file as safe_save_file` in
transformers), yet import nothing itself (importing torch at start-up would cost every Python process of
the tree seconds, and a script that never uses torch nothing).  So a finder first on `sys.meta_path` answers
only for the watched names: it asks the other finders for the real spec and sets, on that module's own
loader object, an `exec_module` that runs the real one and then the callbacks — while the module is already in
`sys.modules`, before the statement that imported it returns.  Nothing else about the module changes: its
spec, its loader's class, `__file__`, are the ones the import system found (the attribute is removed again
as the module executes).

A callback runs while its module's parent package may still be executing (torch.serialization finishes in the
middle of torch/__init__.py): it must use the module it is given, not `import torch`.  A callback that
raises is handed to `on_error`; the import itself never fails because of a hook, and a module whose own code
raises gets no callback (its import fails as it would have).

Standard library only.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Dict, List, Optional

Callback = Callable[[Any], None]
OnError = Callable[[str, Callback, BaseException], None]


class PostImportHooks:
    """A `sys.meta_path` finder that runs callbacks after watched modules execute (see the module docstring)."""

    def __init__(self, on_error: Optional[OnError] = None):
        self._pending: Dict[str, List[Callback]] = {}
        self._finding: set = set()
        self._lock = threading.RLock()
        self._on_error = on_error

    # ---- registering -----------------------------------------------------------------------------

    def register(self, name: str, callback: Callback) -> None:
        """Run `callback(module)` once `name` has been imported (at once if it already is)."""
        with self._lock:
            module = sys.modules.get(name)
            if module is not None and not _initializing(module):
                ready = True
            else:
                ready = False
                self._pending.setdefault(name, []).append(callback)
                if not any(f is self for f in sys.meta_path):
                    sys.meta_path.insert(0, self)
        if ready:
            self._run(name, callback, module)

    def pending(self) -> List[str]:
        with self._lock:
            return sorted(self._pending)

    def uninstall(self) -> None:
        with self._lock:
            self._pending.clear()
            self._remove()

    # ---- the finder ------------------------------------------------------------------------------

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in self._pending or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            spec = self._find_elsewhere(fullname, path, target)
        except Exception:
            return None  # the import system asks the other finders itself and meets the same error there
        finally:
            self._finding.discard(fullname)
        if spec is not None and spec.loader is not None:
            try:
                self._hook_loader(spec, fullname)
            except Exception:
                pass  # the module imports as it would have, unhooked
        return spec

    def _find_elsewhere(self, fullname: str, path, target):
        for finder in list(sys.meta_path):
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def _hook_loader(self, spec, fullname: str) -> None:
        loader = spec.loader
        original = getattr(loader, "exec_module", None)
        if original is None:
            return  # a legacy loader (load_module only): not hooked
        hooks = self

        def exec_module(module):
            try:
                if vars(loader).get("exec_module") is exec_module:
                    del loader.exec_module
            except TypeError:
                pass
            original(module)
            hooks._fire(fullname, module)

        try:
            loader.exec_module = exec_module  # this module's own loader object (file finders make one per module)
        except (AttributeError, TypeError):
            spec.loader = _HookedLoader(loader, exec_module)

    # ---- running ---------------------------------------------------------------------------------

    def _fire(self, name: str, module) -> None:
        with self._lock:
            callbacks = self._pending.pop(name, [])
            if not self._pending:
                self._remove()
        for callback in callbacks:
            self._run(name, callback, module)

    def _run(self, name: str, callback: Callback, module) -> None:
        try:
            callback(module)
        except Exception as exc:
            if self._on_error is not None:
                try:
                    self._on_error(name, callback, exc)
                except Exception:
                    pass

    def _remove(self) -> None:
        try:
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        except Exception:
            pass


class _HookedLoader:
    """A loader that will not take an attribute: the original, with `exec_module` replaced."""

    def __init__(self, loader, exec_module):
        self._loader = loader
        self.exec_module = exec_module

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


def _initializing(module) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


__all__ = ["PostImportHooks"]
