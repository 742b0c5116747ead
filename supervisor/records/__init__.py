"""What the run has established on disk, and nothing that decides: `state.json` and the run's record
(`run_state.RunRecord`), the checkpoint ledger and the resume choice, the goodput ledger (`goodput.json`), the
run-dir lock.  What self-healing decides lives with its concern (`concerns.oom_remediation`).

May import (`MAY_IMPORT`): `processes` (process identities recorded in state.json) and `hangwatch.common`.
"""

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ("processes",)
