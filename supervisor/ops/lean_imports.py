"""Importing a library without what the supervisor never uses of it: a long-running process pays for every
module it holds, in resident memory, for days.

`import_without(module, defer=..., hide=...)` imports `module` while each name in `defer` is a stand-in that
imports the real module the first time anything asks it for an attribute (never, for the supervisor), and each
name in `hide` is absent (`import` raises ImportError, so the library takes its fallback).  The stand-ins leave
`sys.modules` once `module` is imported: a later `import` anywhere gets the real module.  Used for structlog
(rich, asyncio: ops.logsetup) and pydantic (`secrets`, which pulls in OpenSSL's libcrypto through hmac —
3 MiB resident — for a comparison of secret types the config never makes).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Iterable


class OnFirstUse(types.ModuleType):
    """Stands in for a module while another one imports it: the real module is imported when something asks the
    stand-in for an attribute, never before."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):  # introspection (copy, pickle, typing) is not a use
            raise AttributeError(name)
        if sys.modules.get(self.__name__) is self:  # asked while still standing in: let the real one load
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), name)


def import_without(module: str, defer: Iterable[str] = (), hide: Iterable[str] = ()) -> None:
    """Import `module` with `defer` standing in and `hide` absent (see the module docstring); nothing happens when
    it is already imported, and a name already imported is left as it is."""
    if module in sys.modules:
        return
    stand_ins: dict[str, object] = {name: OnFirstUse(name) for name in defer}
    stand_ins.update({name: None for name in hide})  # `import name` raises ImportError
    placed = {name: m for name, m in stand_ins.items() if name not in sys.modules}
    sys.modules.update(placed)
    try:
        importlib.import_module(module)
    finally:
        for name, m in placed.items():
            if sys.modules.get(name) is m:
                del sys.modules[name]
