"""The supervisor's loop: the state machine and nothing else.

Owns: `Supervisor` (drain events → check deadlines → the current state's handler → the concerns' and the
bookkeeping's turn), the selector the loop sleeps in (`wakeup`) and the control requests (which only record
intents: `control_requests`).  The rules it applies (states, outcome, policy) are `rules/`; what it watches for
besides the deadlines are `concerns/`; what it shows is the read model (`read_model/`).

May import (`MAY_IMPORT`): every other part of the supervisor but `cli`.  Only `app` imports the loop.
"""

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = (
    "concerns",
    "control",
    "escalation",
    "incidents",
    "nodes",
    "ops",
    "processes",
    "read_model",
    "records",
    "rules",
    "watch",
)
