"""The supervisor's loop and the one object that owns its state.

Owns: `Supervisor` (drain events → check deadlines → the current state's handler → bookkeeping), the
one read model built once per pass (`view`), the selector the loop sleeps in (`wakeup`) and the control
requests (which only record intents).  The rules it applies (states, outcome, policy) are `rules/`.

May import: every other part of the supervisor but `cli`.  Only `app` imports the loop (and `ops`, for
the read model's type).
"""
