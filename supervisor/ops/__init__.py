"""Telling the outside: systemd notify, alerts (apprise, a command), the dead-man's ping, Prometheus
metrics, and the supervisor's own logging.  Listeners of the loop: they never block it.

May import: `hangwatch.common` and `incidents`; they read the loop through the read model they are handed.
"""
