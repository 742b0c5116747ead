"""Processes: identity, the one `spawn`, the process table behind a seam, an attempt's tree, the prewarmed
standby, what a dead supervisor left behind, the snapshot of a tree and the GPUs, torchrun's command line.

May import: `watch` (an attempt owns its heartbeat tail and straggler watch), `rules` and `hangwatch.common`.
"""
