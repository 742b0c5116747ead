"""What the run has established on disk: `state.json`, the checkpoint ledger and the resume choice,
self-healing's record (OOM remediation, quarantined examples), the run-dir lock.

May import: `processes` (process identities recorded in state.json) and `hangwatch.common`.
"""
