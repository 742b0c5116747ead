"""Several machines behind one interface: the loop talks to `interface.Nodes` — a single-node null object on
one box, the multi-node implementation over torchrun's c10d store otherwise (generations, peers' notices,
lost peers, the agreed resume point), the peer-link helper, and what a node's incidents say of its peers.
Nodes amend an episode's incident through the episode, and return decisions rather than writing them.

May import (`MAY_IMPORT`): `escalation`, `processes`, `watch`, `incidents`, `records`, `rules` and
`hangwatch.common`; never `loop` or `concerns`.
"""

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ("escalation", "incidents", "processes", "records", "rules", "watch")
