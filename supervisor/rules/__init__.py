"""The supervisor's rules: pure decisions and their vocabulary, table-tested, with no I/O.

Owns: the lifecycle states (an Enum whose members know whether they are watched, escalating or final)
and the only transitions allowed between them; what follows a worker's end (`outcome.next_outcome`: an
operator's intent against the restart policy's decision); the restart policy (backoff, crash loop,
no progress); a rank's do-not-restart error under torchrun (`no_retry`); a crash in teardown (`teardown`); what
an out-of-memory failure of the built-in worker says about memory (`oom_evidence`) and the setting the next attempt
runs with (`oom_remediation`, on the ladder of `hangwatch.common.oom_ladder`).

May import (`MAY_IMPORT`): `hangwatch.common` only — every other part of the supervisor may import it.
"""

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ()
