"""Incidents: one directory per failure, the evidence in it, and what the evidence says.

    dumps.py     faulthandler dumps: threads, the main thread's stack, the stuck frame
    landmarks.py the call a stack is in (generate, a collective, the DataLoader, …), the user's frame that called it
    loader_workers.py  a DataLoader's worker processes: which one is stuck, which are idle
    classify.py  the classification of a stall (CPU, state) and of an exit (last words, code, signal, log)
    collectives.py  whether a rank waits for its peers, and in which collective (its stack, py-spy's native frames)
    verdict.py   a multi-rank stall: each rank on its own evidence → the culprit rank, the victims, or "cannot tell"
    store.py     Incident, IncidentStore: `incidents/NNNN-<kind>/incident.json` and the evidence files

Kinds: stall, livelock, startup_timeout, manual, crash, oom, nan, signal, config_error, data_error,
crash_loop.
"""

from hangwatch.supervisor.incidents.classify import (
    classify_exit,
    classify_stall,
    last_exception_line,
    signal_name,
    sleeping,
)
from hangwatch.supervisor.incidents.dumps import (
    ThreadStack,
    fatal_error,
    frame_str,
    main_stack,
    main_thread,
    parse_faulthandler,
    stuck_frame,
)
from hangwatch.supervisor.incidents.store import KINDS, Incident, IncidentStore, summary_of

__all__ = [
    "KINDS",
    "Incident",
    "IncidentStore",
    "ThreadStack",
    "classify_exit",
    "classify_stall",
    "sleeping",
    "fatal_error",
    "frame_str",
    "last_exception_line",
    "main_stack",
    "main_thread",
    "parse_faulthandler",
    "signal_name",
    "stuck_frame",
    "summary_of",
]

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ()
