"""The `hangwatch` command: run a supervisor (through `app`), talk to a running one over its control
socket (`client`, `remote`), render status, incidents and stacks, follow logs, build the run report.

May import: every other part of the supervisor; nothing imports `cli`.
"""

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ("app", "control", "incidents", "ops", "processes", "records", "watch")
