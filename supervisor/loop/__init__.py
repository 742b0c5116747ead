"""The supervisor's loop and the one object that owns its state.

Owns: `Supervisor` (drain events → check deadlines → the current state's handler → bookkeeping), the
state enum and its transition table, what follows an episode (`outcome`), the restart policy, the one
read model built once per pass (`view`), the selector the loop sleeps in (`wakeup`) and the control
commands (which only record intents).

May import: `watch`, `processes`, `episode`, `incidents`, `records`, `nodes`, `ops` (notify, logsetup),
`control` and `hangwatch.common`.  Nothing else in the supervisor imports `loop` but `app` and `cli`.
"""
