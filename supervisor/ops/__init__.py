"""Telling the outside: systemd notify, alerts (apprise, a command), the dead-man's ping, Prometheus
metrics, and the supervisor's own logging.  Listeners of the loop: they never block it.

May import: `hangwatch.common`, `incidents`, `rules` and, for annotations only, `watch` (a rank's tracker) and
`loop.view` (the read model they are handed once a pass); they never read the supervisor itself.
"""
