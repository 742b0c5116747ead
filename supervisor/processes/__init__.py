"""Processes: identity, the one `spawn`, the process table behind a seam, an attempt's tree, the prewarmed
standby's process (`standby`), what a dead supervisor left behind, the snapshot of a tree and the GPUs, torchrun's
command line.

May import (`MAY_IMPORT`): `watch` (an attempt owns its heartbeat tail and straggler watch), `rules` and
`hangwatch.common`.
"""

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ("rules", "watch")
