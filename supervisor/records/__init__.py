"""What the run has established on disk, and nothing that decides: `state.json` and the run's record
(`run_state.RunRecord`), the checkpoint ledger and the resume choice, the goodput ledger (`goodput.json`), the
run-dir lock, self-healing's records (`healing`: remediation.json, quarantine.jsonl) and the memory evidence an
out-of-memory failure left (`memory_evidence`).  What self-healing decides is `rules.oom_remediation`.

May import (`MAY_IMPORT`): `processes` (process identities recorded in state.json), `rules` (the pure vocabulary a
record is read with: what remediation.json's setting means, the memory evidence's type) and `hangwatch.common`.
"""

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ("processes", "rules")
