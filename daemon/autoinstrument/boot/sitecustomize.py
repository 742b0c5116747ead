"""hangwatch's bootstrap: Python imports this `sitecustomize` at start-up because the supervisor put this folder
first on the worker's PYTHONPATH (`worker.instrument: auto`, common/instrumentation.py).

It does two things, in this order:

1. Chains to the `sitecustomize` the environment would have imported without hangwatch (a conda env's, a
   distribution's, the user's own on PYTHONPATH): this folder is taken off sys.path for the length of one
   `import sitecustomize`, then put back where it was.  An error in that module is printed as Python's own
   `site` prints it, and stops nothing of ours; that module then stays `sys.modules["sitecustomize"]`, as it
   would have been.

2. Under hangwatch (HANGWATCH_RUN_DIR set, HANGWATCH_INSTRUMENT == "auto") instruments this process:
   `hangwatch.daemon.autoinstrument.install()`.  In the interpreter of hangwatch's own environment that
   package imports as usual; in another one (a user's conda env with its own torch) a finder maps
   `hangwatch.common` and `hangwatch.daemon` onto their source under HANGWATCH_SOURCE_ROOT — the standard
   library pieces only, never hangwatch's dependencies.  An interpreter older than MIN_PYTHON says so in one
   line and is left alone.  Any error is one line on stderr, and the program runs on uninstrumented:
   hangwatch must never be the reason a training script does not start.

Written in conservative syntax on purpose (no f-strings, annotations or `:=`): every Python of the worker's
tree reads this file, whatever its version, and one that cannot parse it would print a SyntaxError at
start-up instead of the one line that explains.
"""

import os
import sys

MIN_PYTHON = (3, 9)  # keep in step with hangwatch.common.instrumentation.MIN_PYTHON (a test checks)
TOO_OLD_NOTED = "HANGWATCH_TOO_OLD_NOTED"  # set once said, so the process's Python children stay quiet
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE_FOLDERS = {"hangwatch.common": "common", "hangwatch.daemon": "daemon"}
_HANGWATCH_NAMES = (
    "hangwatch",
    "hangwatch.common",
    "hangwatch.daemon",
    "hangwatch.daemon.heartbeat",
    "hangwatch.common.protocol",
    "hangwatch.common.rundir",
)


def _real(path):
    try:
        return os.path.realpath(path or os.curdir)
    except Exception:
        return path


def _boot_dirs():
    dirs = set([_real(_HERE)])
    named = os.environ.get("HANGWATCH_BOOT_DIR")
    if named:
        dirs.add(_real(named))
    return dirs


def _chain():
    """Import the sitecustomize that the environment would have imported, had this folder not come first."""
    ours = sys.modules.get("sitecustomize")
    boot = _boot_dirs()
    removed = [(i, p) for i, p in enumerate(sys.path) if _real(p) in boot]
    for i, _ in reversed(removed):
        del sys.path[i]
    sys.modules.pop("sitecustomize", None)
    try:
        try:
            __import__("sitecustomize")
        except ImportError:
            exc = sys.exc_info()[1]
            name = getattr(exc, "name", None)
            if name != "sitecustomize" and not (name is None and "sitecustomize" in str(exc)):
                raise
    except Exception:
        # As site.execsitecustomize reports it: the user's module failing is theirs to see.
        err = sys.exc_info()[1]
        if sys.flags.verbose:
            sys.excepthook(*sys.exc_info())
        else:
            sys.stderr.write(
                "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n%s: %s\n" % (err.__class__.__name__, err)
            )
    finally:
        for i, p in removed:  # back where they were; whatever that module added to sys.path stays
            sys.path.insert(min(i, len(sys.path)), p)
        if "sitecustomize" not in sys.modules and ours is not None:
            sys.modules["sitecustomize"] = ours


class _SourceFinder(object):
    """Maps `hangwatch` (a namespace), `hangwatch.common` and `hangwatch.daemon` onto hangwatch's source tree,
    for an interpreter whose environment has no hangwatch; everything below them is found by the usual
    path-based import inside those two folders."""

    def __init__(self, root):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "hangwatch":
            from importlib.machinery import ModuleSpec

            return ModuleSpec("hangwatch", None, is_package=True)
        folder = _SOURCE_FOLDERS.get(fullname)
        if folder is None:
            return None
        location = os.path.join(self.root, folder)
        init = os.path.join(location, "__init__.py")
        if not os.path.isfile(init):
            return None
        from importlib.util import spec_from_file_location

        return spec_from_file_location(fullname, init, submodule_search_locations=[location])


def _make_importable():
    """hangwatch's worker side importable: as installed in this environment, else from its source tree."""
    try:
        __import__("hangwatch.daemon.heartbeat")
        return
    except ImportError:
        exc = sys.exc_info()[1]
        if getattr(exc, "name", None) not in _HANGWATCH_NAMES:
            raise
    root = os.environ.get("HANGWATCH_SOURCE_ROOT")
    if not root or not os.path.isdir(os.path.join(root, "daemon")):
        raise ImportError(
            "hangwatch is not installed in this environment and HANGWATCH_SOURCE_ROOT (%r) "
            "holds no hangwatch source" % (root,)
        )
    sys.meta_path.insert(0, _SourceFinder(root))


def _instrument():
    env = os.environ
    if env.get("HANGWATCH_INSTRUMENT") != "auto" or not env.get("HANGWATCH_RUN_DIR"):
        return
    if tuple(sys.version_info[:2]) < MIN_PYTHON:
        if not env.get(TOO_OLD_NOTED):
            sys.stderr.write(
                "hangwatch: Python %d.%d is too old for instrumentation (needs %d.%d+): this process "
                "is watched by its output, py-spy and NVML only\n"
                % (sys.version_info[0], sys.version_info[1], MIN_PYTHON[0], MIN_PYTHON[1])
            )
            env[TOO_OLD_NOTED] = "1"
        return
    try:
        _make_importable()
        __import__("hangwatch.daemon.autoinstrument")
        sys.modules["hangwatch.daemon.autoinstrument"].install()
    except Exception:
        err = sys.exc_info()[1]
        try:
            sys.stderr.write(
                "hangwatch: instrumentation disabled in this process: %s: %s\n" % (err.__class__.__name__, err)
            )
        except Exception:
            pass


if __name__ == "sitecustomize":  # imported by `site` at start-up; imported under its package name, it only defines
    try:
        _chain()
    except Exception:
        pass  # the chaining's own bookkeeping (sys.path, sys.modules) failing must not stop the program
    _instrument()
