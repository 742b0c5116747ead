"""Several machines behind one seam: the loop talks to a `Nodes` interface — a single-node null object on
one box, the multi-node implementation over torchrun's c10d store otherwise (generations, peers' notices,
lost peers, the agreed resume point), the peer-link helper, and what a node's incidents say of its peers.

May import: `episode`, `processes`, `watch`, `incidents`, `records` and `hangwatch.common`; never `loop`.
"""
