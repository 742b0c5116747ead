"""Watching a running attempt: reading its heartbeat files, the deadlines they arm, calibration, stragglers.

Pure bookkeeping over heartbeat lines and the files' growth; nothing here signals, spawns or writes an
incident.  May import: `hangwatch.common` and the third-party `watchdog` (file events).
"""

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ()
