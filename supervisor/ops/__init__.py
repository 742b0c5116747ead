"""Telling the outside: systemd notify, alerts (apprise, a command), the dead-man's ping, Prometheus
metrics, the supervisor's own logging, and the run's last word for Kubernetes (the container's termination
message, written once the loop has returned).  Listeners of the loop: they never block it.

May import (`MAY_IMPORT`): `hangwatch.common`, `incidents`, `rules` and, for annotations only, `watch` (a rank's
tracker) and `read_model` (the read model they are handed once a pass); they never read the loop itself.
"""

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ("incidents", "read_model", "rules", "watch")
