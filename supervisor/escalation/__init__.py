"""One failure (or end) of a worker, from detection until its process tree is gone: the escalation.

Owns: the episode (snapshot → dumps → kill → incident; it owns its incident and saves it through the store), the
dump collector, the tree killer, DataLoader workers' and the NCCL flight recorder's dumps, the kernel's evidence
(OOM kills), each rank's evidence for the verdict, and the incidents of exits, failed spawns and crash loops.
The episode's decision is the loop's to assemble (`loop.supervisor.asked`); the episode carries it.

May import (`MAY_IMPORT`): `processes`, `watch`, `incidents`, `records`, `rules` and `hangwatch.common`; never
`loop`, `nodes` or `concerns`.
"""

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ("incidents", "processes", "records", "rules", "watch")
