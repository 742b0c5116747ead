"""The per-process state of the automatic instrumentation, and how its hooks fail without breaking the run.

One `Context` per rank process: its shared heartbeat, the thread that trains, the step it resumes from, the
checkpoint the supervisor handed it, and one `Hook` per wrapped thing.  Every wrapper and hook follows the same
rule: hangwatch's own bookkeeping runs inside `try`, the user's call outside it; the first error of a hook is
reported as one `warn` beat (`instrumentation error in <hook>: …`) and the hook is switched off (its wrapper
then only calls through), so a bug or a surprise in a library version costs the run that hook's beats, never
the run.

Standard library only.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Dict, Mapping, Optional

from hangwatch.common.protocol import ENV_RESUME_FROM, ENV_RUN_DIR
from hangwatch.daemon.heartbeat import WRITERS, Heartbeat

# Phases the automatic instrumentation may leave for one of its own (eval, checkpoint): those that mean
# "training or getting ready to", never one a callback or the script entered.
BASE_PHASES = ("train", "load", "init")


class Hook:
    """One hook's switch: `on` until its first error."""

    __slots__ = ("name", "on")

    def __init__(self, name: str):
        self.name = name
        self.on = True


class Context:
    """What every hook of one rank process shares."""

    def __init__(self, hb: Heartbeat, rank: int, resume_step: int, environ: Mapping[str, str]):
        self.hb = hb
        self.rank = rank
        self.pid = os.getpid()
        self.active = True  # False in a child forked from this process (a DataLoader worker): not the rank
        self.train_thread = threading.get_ident()  # the thread that beats: the one that steps the optimizer
        self.resume_step = resume_step
        self.resume_from: Optional[str] = environ.get(ENV_RESUME_FROM) or None
        self.run_dir: Optional[str] = environ.get(ENV_RUN_DIR) or None  # where the supervisor's records are
        self.hooks: Dict[str, Hook] = {}
        self.errors: Dict[str, str] = {}  # hook name → its first error, as reported

    # ---- hooks and their errors ---------------------------------------------------------------

    def hook(self, name: str) -> Hook:
        h = self.hooks.get(name)
        if h is None:
            h = self.hooks[name] = Hook(name)
        return h

    def failed(self, hook: Hook, exc: BaseException) -> None:
        """Hook `hook` raised `exc` in hangwatch's own code: report it once, switch the hook off."""
        if not hook.on:
            return
        hook.on = False
        message = "instrumentation error in %s: %s: %s" % (hook.name, type(exc).__name__, exc)
        self.errors[hook.name] = message
        try:
            if not self.hb.closed:
                self.hb.warn(message[:1000], hook=hook.name)
                return
        except Exception:
            pass
        try:
            sys.stderr.write("hangwatch: %s\n" % message)
            sys.stderr.flush()
        except Exception:
            pass

    # ---- who may beat what -----------------------------------------------------------------------

    def in_train_thread(self) -> bool:
        return threading.get_ident() == self.train_thread

    @staticmethod
    def manual() -> bool:
        """The script drives a heartbeat of its own: the automatic instrumentation writes nothing more."""
        return WRITERS.manual

    @staticmethod
    def steps_elsewhere() -> bool:
        return WRITERS.steps_elsewhere

    def phases_elsewhere(self) -> bool:
        """A callback drives the phases now, or the script its own heartbeat."""
        return WRITERS.manual or bool(WRITERS.phase_owners)

    def usable(self) -> bool:
        """This process's hooks may write: it is the rank (not a forked child), the heartbeat is open, and the
        script has not said `stop` through it (a HangwatchCallback the script added: what follows its `stop`,
        a final `save_model`, is no part of the run the supervisor watches)."""
        return self.active and not self.hb.closed and not self.hb.stopped

    # ---- phases -----------------------------------------------------------------------------------

    def enter_phase(self, name: str, budget_s: Optional[float] = None) -> None:
        self.hb.enter_phase(name, budget_s)

    def forked(self) -> None:
        """os.register_at_fork(after_in_child=…): the child is no rank; every hook there only calls through."""
        self.active = False


__all__ = ["Context", "Hook", "BASE_PHASES"]
